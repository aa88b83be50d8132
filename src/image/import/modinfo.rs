//! `modinfo` without kmod: a kernel module's `.modinfo` ELF section, NUL-separated
//! `key=value` strings (`version=550.127.05`, `vermagic=...`). The ELF is read with the
//! `object` crate; compressed modules (`.ko.zst`) are decompressed first.

use std::collections::BTreeMap;

use object::{Object, ObjectSection};

/// The `.modinfo` keys of a module's bytes; a key given twice keeps its first value
/// (`alias=` repeats; `version=` does not).
pub fn parse(module: &[u8]) -> Result<BTreeMap<String, String>, String> {
    let file = object::File::parse(module).map_err(|e| format!("not an ELF object: {e}"))?;
    let section = file
        .section_by_name(".modinfo")
        .ok_or("no .modinfo section")?;
    let data = section
        .data()
        .map_err(|e| format!("unreadable .modinfo: {e}"))?;
    let mut info = BTreeMap::new();
    for record in data.split(|b| *b == 0) {
        let Ok(text) = std::str::from_utf8(record) else {
            continue;
        };
        if let Some((key, value)) = text.split_once('=') {
            info.entry(key.to_string())
                .or_insert_with(|| value.to_string());
        }
    }
    Ok(info)
}

/// The largest decompressed module read.
const MAX_DECOMPRESSED: u64 = 512 << 20;

/// A module file's bytes, decompressed by its name (`.ko`, `.ko.zst`).
pub fn decompress(name: &str, bytes: Vec<u8>) -> Result<Vec<u8>, String> {
    if name.ends_with(".ko") {
        Ok(bytes)
    } else if name.ends_with(".ko.zst") {
        // Bounded: a hostile module may declare any size.
        use std::io::Read;
        let mut out = Vec::new();
        zstd::stream::read::Decoder::new(bytes.as_slice())
            .map_err(|e| format!("{name}: {e}"))?
            .take(MAX_DECOMPRESSED + 1)
            .read_to_end(&mut out)
            .map_err(|e| format!("{name}: {e}"))?;
        if out.len() as u64 > MAX_DECOMPRESSED {
            return Err(format!("{name} decompresses past {MAX_DECOMPRESSED} bytes"));
        }
        Ok(out)
    } else {
        Err(format!(
            "{name}: only .ko and .ko.zst modules are read (xz-compressed modules are not supported yet)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_is_not_a_module() {
        assert!(parse(b"not an elf").unwrap_err().contains("not an ELF"));
        assert!(decompress("x.ko.xz", vec![]).unwrap_err().contains("xz"));
    }
}
