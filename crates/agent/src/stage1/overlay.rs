//! The per-node overlay: files the server renders for this node (hostname, machine-id,
//! keys, configuration chosen by label), fetched by stage 1 and written into the new
//! root's writable layer before switch_root. Never baked into the image, so one image
//! digest serves the whole fleet.
//!
//! The tar comes from our server over plain HTTP, so it is still checked: regular files
//! and directories only, relative names without `..`, and a file replaces whatever the
//! image has at its path (a symlink there is removed, not followed).

use std::fs;
use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

use super::Stage1Error;

/// The most an overlay may be (it holds small configuration files).
pub const MAX_OVERLAY_BYTES: u64 = 16 << 20;

/// Writes the overlay tar `bytes` under `into`; returns the files written.
pub fn apply(bytes: &[u8], into: &Path) -> Result<Vec<PathBuf>, Stage1Error> {
    let invalid = |m: String| Stage1Error::Invalid(format!("overlay: {m}"));
    let mut archive = tar::Archive::new(bytes);
    let mut written = Vec::new();
    for entry in archive.entries().map_err(|e| invalid(e.to_string()))? {
        let mut entry = entry.map_err(|e| invalid(e.to_string()))?;
        let name = entry
            .path()
            .map_err(|e| invalid(e.to_string()))?
            .into_owned();
        let relative = checked(&name).ok_or_else(|| invalid(format!("refused name {name:?}")))?;
        let target = into.join(&relative);
        refuse_linked_parents(into, &relative)?;
        let mode = entry.header().mode().unwrap_or(0o644) & 0o7777;
        match entry.header().entry_type() {
            tar::EntryType::Directory => {
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(mode)
                    .create(&target)
                    .map_err(|e| Stage1Error::io("create directory", &target, e))?;
            }
            tar::EntryType::Regular => {
                if let Some(parent) = target.parent() {
                    fs::create_dir_all(parent)
                        .map_err(|e| Stage1Error::io("create directory", parent, e))?;
                }
                let mut content = Vec::new();
                entry
                    .read_to_end(&mut content)
                    .map_err(|e| invalid(e.to_string()))?;
                replace(&target, &content, mode)?;
                written.push(relative);
            }
            other => return Err(invalid(format!("{name:?} is a {other:?}, not a file"))),
        }
    }
    Ok(written)
}

/// Every directory on the way to `relative` under `into` that exists must be a directory,
/// not a link: a link there (even an absolute one, which would point into this
/// initramfs) would put the node's files somewhere else.
fn refuse_linked_parents(into: &Path, relative: &Path) -> Result<(), Stage1Error> {
    let mut at = into.to_path_buf();
    let parts: Vec<_> = relative.components().collect();
    for part in &parts[..parts.len().saturating_sub(1)] {
        at.push(part);
        match fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(Stage1Error::Invalid(format!(
                    "overlay: {} is a link in the image; its files are not written through it",
                    at.display()
                )));
            }
            _ => {}
        }
    }
    Ok(())
}

/// `name` as a plain relative path, or None if it would leave the root.
fn checked(name: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for part in name.components() {
        match part {
            Component::Normal(p) => out.push(p),
            Component::CurDir => {}
            _ => return None,
        }
    }
    (!out.as_os_str().is_empty()).then_some(out)
}

/// Puts `content` at `path` in place of whatever is there (a symlink is not followed).
fn replace(path: &Path, content: &[u8], mode: u32) -> Result<(), Stage1Error> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => {
            return Err(Stage1Error::Invalid(format!(
                "overlay: {} is a directory in the image",
                path.display()
            )));
        }
        Ok(_) => fs::remove_file(path).map_err(|e| Stage1Error::io("replace", path, e))?,
        Err(_) => {}
    }
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| Stage1Error::io("write", path, e))?;
    std::io::Write::write_all(&mut file, content).map_err(|e| Stage1Error::io("write", path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tar(entries: &[(&str, &[u8], u32)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (name, data, mode) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_mode(*mode);
            h.set_size(data.len() as u64);
            h.set_entry_type(tar::EntryType::Regular);
            b.append_data(&mut h, name, *data).unwrap();
        }
        b.into_inner().unwrap()
    }

    #[test]
    fn files_replace_what_the_image_has_even_a_symlink() {
        let root = tempfile::tempdir().unwrap();
        fs::create_dir_all(root.path().join("etc")).unwrap();
        let outside = root.path().join("outside");
        fs::write(&outside, b"keep").unwrap();
        std::os::unix::fs::symlink(&outside, root.path().join("etc/hostname")).unwrap();
        let written = apply(
            &tar(&[
                ("etc/hostname", b"node-1\n", 0o644),
                ("root/.ssh/authorized_keys", b"ssh-ed25519 AAAA\n", 0o600),
            ]),
            root.path(),
        )
        .unwrap();
        assert_eq!(written.len(), 2);
        assert_eq!(
            fs::read(root.path().join("etc/hostname")).unwrap(),
            b"node-1\n"
        );
        assert_eq!(
            fs::read(&outside).unwrap(),
            b"keep",
            "the link was not followed"
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(root.path().join("root/.ssh/authorized_keys"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn a_linked_parent_directory_is_refused() {
        let root = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/tmp", root.path().join("etc")).unwrap();
        let e = apply(&tar(&[("etc/hostname", b"x\n", 0o644)]), root.path()).unwrap_err();
        assert!(e.to_string().contains("is a link"), "{e}");
    }

    #[test]
    fn names_that_leave_the_root_are_refused() {
        assert_eq!(checked(Path::new("../etc/passwd")), None);
        assert_eq!(checked(Path::new("/etc/passwd")), None);
        assert_eq!(
            checked(Path::new("./etc/hosts")),
            Some(PathBuf::from("etc/hosts"))
        );
    }
}
