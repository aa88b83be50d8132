//! A reader between the decompressor and the tar parser that bounds extension headers.
//!
//! The `tar` crate reads a GNU long name (`L`), long link (`K`) or PAX header (`x`, `g`)
//! whole into memory, whatever size it declares: a 109 KB `.tar.zst` declaring a 12 GB
//! long name cost 12.6 GB of RAM. It has no limit to set, so this reader follows the
//! archive's 512-byte blocks as they stream past and fails the read the moment a header
//! declares an extension larger than `MAX_EXTENSION_BYTES`, before the parser allocates.
//!
//! It must know where each header is, so it tracks entry sizes as the parser will: from
//! the header's size field (octal or GNU base-256), or from a PAX `size=` record, which
//! overrides it for the next entry (GNU tar writes one for files over 8 GiB).

use std::io::{self, Read};

/// The largest extension header accepted: long names and PAX records of real bundles
/// are well under a KiB.
pub const MAX_EXTENSION_BYTES: u64 = 64 * 1024;

const BLOCK: usize = 512;

pub struct TarGuard<R> {
    inner: R,
    /// Bytes of entry data (and padding) still to pass before the next header.
    skip: u64,
    header: [u8; BLOCK],
    filled: usize,
    /// The PAX extension being passed, kept to read its `size=` record.
    pax: Option<Vec<u8>>,
    /// A PAX `size=` for the next entry.
    next_size: Option<u64>,
}

impl<R: Read> TarGuard<R> {
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            skip: 0,
            header: [0; BLOCK],
            filled: 0,
            pax: None,
            next_size: None,
        }
    }

    /// Follows `bytes` through the block structure.
    fn follow(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            if self.skip > 0 {
                let n = bytes
                    .len()
                    .min(usize::try_from(self.skip).unwrap_or(usize::MAX));
                if let Some(pax) = &mut self.pax {
                    pax.extend_from_slice(&bytes[..n]);
                }
                self.skip -= n as u64;
                bytes = &bytes[n..];
                if self.skip == 0
                    && let Some(pax) = self.pax.take()
                {
                    self.next_size = pax_size(&pax);
                }
                continue;
            }
            let n = bytes.len().min(BLOCK - self.filled);
            self.header[self.filled..self.filled + n].copy_from_slice(&bytes[..n]);
            self.filled += n;
            bytes = &bytes[n..];
            if self.filled == BLOCK {
                self.filled = 0;
                self.on_header()?;
            }
        }
        Ok(())
    }

    fn on_header(&mut self) -> io::Result<()> {
        let h = &self.header;
        if h.iter().all(|&b| b == 0) {
            return Ok(()); // end-of-archive blocks
        }
        let kind = h[156];
        let declared = size_field(&h[124..136])
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad tar size field"))?;
        let extension = matches!(kind, b'L' | b'K' | b'x' | b'g');
        if extension && declared > MAX_EXTENSION_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "a tar extension header declares {declared} bytes, over the limit of {MAX_EXTENSION_BYTES}"
                ),
            ));
        }
        if kind == b'S' {
            // GNU sparse headers continue in blocks the size does not count; bundles
            // refuse sparse entries anyway.
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "sparse tar entries are not allowed",
            ));
        }
        // A PAX size applies to the entry after the extensions that carry it.
        let size = if extension {
            declared
        } else {
            self.next_size.take().unwrap_or(declared)
        };
        if kind == b'x' {
            self.pax = Some(Vec::with_capacity(declared as usize));
        }
        self.skip = size.div_ceil(BLOCK as u64) * BLOCK as u64;
        if self.skip == 0
            && let Some(pax) = self.pax.take()
        {
            self.next_size = pax_size(&pax);
        }
        Ok(())
    }
}

impl<R: Read> Read for TarGuard<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.follow(&buf[..n])?;
        Ok(n)
    }
}

/// A tar numeric field: octal digits (NUL or space ended) or GNU base-256 (high bit set).
fn size_field(field: &[u8]) -> Option<u64> {
    if field[0] & 0x80 != 0 {
        let mut value: u64 = u64::from(field[0] & 0x7f);
        for &b in &field[1..] {
            value = value.checked_mul(256)?.checked_add(u64::from(b))?;
        }
        return Some(value);
    }
    let text = std::str::from_utf8(field).ok()?;
    let digits = text.trim_matches(|c: char| c == '\0' || c == ' ');
    if digits.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(digits, 8).ok()
}

/// The `size` record of PAX extension data (`"<len> size=<n>\n"` records, then the
/// block's NUL padding), if any.
fn pax_size(data: &[u8]) -> Option<u64> {
    let mut rest = data;
    let mut size = None;
    while let Some(space) = rest.iter().position(|&b| b == b' ') {
        let Some(len) = std::str::from_utf8(&rest[..space])
            .ok()
            .and_then(|l| l.parse::<usize>().ok())
            .filter(|&l| l > space && l <= rest.len())
        else {
            break;
        };
        let record = &rest[space + 1..len];
        if let Some(value) = record.strip_prefix(b"size=") {
            let value = value.strip_suffix(b"\n").unwrap_or(value);
            size = std::str::from_utf8(value).ok().and_then(|v| v.parse().ok());
        }
        rest = &rest[len..];
    }
    size
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: u8, size: u64) -> [u8; BLOCK] {
        let mut h = [0u8; BLOCK];
        h[..4].copy_from_slice(b"name");
        h[124..135].copy_from_slice(format!("{size:011o}").as_bytes());
        h[156] = kind;
        h
    }

    fn archive(parts: &[(&[u8; BLOCK], Vec<u8>)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (h, data) in parts {
            out.extend_from_slice(*h);
            out.extend_from_slice(data);
            out.resize(out.len().div_ceil(BLOCK) * BLOCK, 0);
        }
        out.extend_from_slice(&[0; BLOCK * 2]);
        out
    }

    /// Reads through the guard in odd-sized pieces, as decompressors hand them out.
    fn pass(bytes: &[u8]) -> io::Result<u64> {
        let mut guard = TarGuard::new(bytes);
        let mut buf = [0u8; 97];
        let mut total = 0;
        loop {
            match guard.read(&mut buf)? {
                0 => return Ok(total),
                n => total += n as u64,
            }
        }
    }

    #[test]
    fn ordinary_entries_and_small_extensions_pass() {
        let name = b"a/long/name".to_vec();
        let bytes = archive(&[
            (&header(b'L', name.len() as u64), name),
            (&header(b'0', 1000), vec![7; 1000]),
            (&header(b'5', 0), vec![]),
        ]);
        assert_eq!(pass(&bytes).unwrap(), bytes.len() as u64);
    }

    #[test]
    fn a_huge_declared_extension_fails_at_its_header() {
        for kind in [b'L', b'K', b'x', b'g'] {
            // Only the header is sent: the failure comes before any of the data.
            let h = header(kind, 7 << 30);
            let err = pass(&h).unwrap_err();
            assert!(err.to_string().contains("over the limit"), "{err}");
        }
    }

    #[test]
    fn a_pax_size_moves_the_next_header() {
        // The next entry's size comes from the PAX record, not its header (0 here); a
        // guard that ignored it would read the entry's data as a header.
        let record = b"16 size=1048576\n".to_vec();
        let mut data = vec![0u8; 1 << 20];
        data[..BLOCK].copy_from_slice(&header(b'L', 1 << 30));
        let bytes = archive(&[
            (&header(b'x', record.len() as u64), record),
            (&header(b'0', 0), data),
        ]);
        assert_eq!(pass(&bytes).unwrap(), bytes.len() as u64);
    }

    /// What GNU tar writes in its gnu and pax formats (long names, PAX records) passes.
    #[test]
    fn gnu_tar_archives_pass() {
        let dir = tempfile::tempdir().unwrap();
        let long = "d".repeat(120);
        std::fs::create_dir(dir.path().join(&long)).unwrap();
        std::fs::write(
            dir.path().join(&long).join("f".repeat(130)),
            vec![1u8; 70_000],
        )
        .unwrap();
        std::fs::write(dir.path().join("small"), b"x").unwrap();
        for format in ["gnu", "pax"] {
            let out = std::process::Command::new("tar")
                .args(["--format", format, "-cf", "-", "-C"])
                .arg(dir.path())
                .arg(".")
                .output()
                .expect("tar runs (apt-get install tar)");
            assert!(out.status.success(), "{format}");
            assert_eq!(
                pass(&out.stdout).unwrap(),
                out.stdout.len() as u64,
                "{format}"
            );
        }
    }

    #[test]
    fn base_256_sizes_are_read() {
        let mut field = [0u8; 12];
        field[0] = 0x80;
        field[7] = 0x02; // 2 << 32
        assert_eq!(size_field(&field), Some(2 << 32));
        assert_eq!(size_field(b"00000001750\0"), Some(1000));
        assert_eq!(
            pax_size(b"20 path=a/b/c/d/e/f\n16 size=1048576\n\0\0\0"),
            Some(1 << 20)
        );
        assert_eq!(pax_size(b"20 path=a/b/c/d/e/f\n"), None);
    }
}
