//! BMC credentials and CA files, read by name from the secrets directory. A name is a
//! plain file name (no path, no leading dot), so no BMC setting can reach outside the
//! directory; a credential file readable by group or others is refused, as ssh refuses a
//! private key that others can read. Passwords never reach `Debug`, logs or the API.

use std::fmt;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The largest secret file read (a credential or a CA bundle).
const MAX_SECRET_BYTES: u64 = 256 * 1024;

/// A BMC's username and password.
#[derive(Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// A container registry's login, bound to that registry.
#[derive(Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistryLogin {
    /// HOST[:PORT], as in `docker://HOST[:PORT]/...`.
    pub registry: String,
    pub username: String,
    pub password: String,
}

impl fmt::Debug for RegistryLogin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryLogin")
            .field("registry", &self.registry)
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error(
        "invalid secret name {0:?}: 1-128 characters from A-Z a-z 0-9 . _ -, not starting with a dot"
    )]
    BadName(String),
    #[error("secret {name:?}: {why}")]
    Unreadable { name: String, why: String },
}

/// Whether `name` may name a secret: a plain file name in the directory.
pub fn valid_name(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The secrets directory.
#[derive(Debug, Clone)]
pub struct Secrets {
    dir: PathBuf,
}

impl Secrets {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The credential `name`: a TOML file with `username` and `password`, mode 0600 or
    /// stricter.
    pub fn credentials(&self, name: &str) -> Result<Credentials, SecretError> {
        let text = self.read(name, true)?;
        toml::from_str(&text).map_err(|e| SecretError::Unreadable {
            name: name.into(),
            // Not the parser's message: it quotes the line, which may hold the password.
            why: format!(
                "not a TOML file with username and password ({})",
                e.span()
                    .map(|s| format!("at byte {}", s.start))
                    .unwrap_or_default()
            ),
        })
    }

    /// The registry login `name`: a TOML file with `registry` (the HOST[:PORT] it is
    /// for), `username` and `password`, mode 0600 or stricter. A BMC credential (no
    /// `registry`) is not one: a login is only ever sent to its own registry.
    pub fn registry_login(&self, name: &str) -> Result<RegistryLogin, SecretError> {
        let text = self.read(name, true)?;
        toml::from_str(&text).map_err(|e| SecretError::Unreadable {
            name: name.into(),
            why: format!(
                "not a registry login: a TOML file with registry, username and password ({})",
                e.span()
                    .map(|s| format!("at byte {}", s.start))
                    .unwrap_or_default()
            ),
        })
    }

    /// The PEM file `name` (a CA certificate to trust).
    pub fn pem(&self, name: &str) -> Result<String, SecretError> {
        self.read(name, false)
    }

    fn read(&self, name: &str, private: bool) -> Result<String, SecretError> {
        if !valid_name(name) {
            return Err(SecretError::BadName(name.into()));
        }
        let unreadable = |why: String| SecretError::Unreadable {
            name: name.into(),
            why,
        };
        let path = self.dir.join(name);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| unreadable(format!("cannot open {}: {e}", path.display())))?;
        let meta = file
            .metadata()
            .map_err(|e| unreadable(format!("cannot stat {}: {e}", path.display())))?;
        if !meta.is_file() {
            return Err(unreadable(format!("{} is not a file", path.display())));
        }
        if private && meta.mode() & 0o077 != 0 {
            return Err(unreadable(format!(
                "{} is readable by group or others (mode {:o}); chmod 600 it",
                path.display(),
                meta.mode() & 0o777
            )));
        }
        let mut text = String::new();
        file.take(MAX_SECRET_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| unreadable(format!("cannot read {}: {e}", path.display())))?;
        if text.len() as u64 > MAX_SECRET_BYTES {
            return Err(unreadable(format!("larger than {MAX_SECRET_BYTES} bytes")));
        }
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn write(dir: &Path, name: &str, text: &str, mode: u32) {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn credentials_are_read_by_name_and_mode_checked() {
        let dir = tempfile::tempdir().unwrap();
        let secrets = Secrets::new(dir.path());
        write(
            dir.path(),
            "rack12",
            "username = \"admin\"\npassword = \"s3cret-pw\"\n",
            0o600,
        );
        let c = secrets.credentials("rack12").unwrap();
        assert_eq!(
            (c.username.as_str(), c.password.as_str()),
            ("admin", "s3cret-pw")
        );
        assert!(!format!("{c:?}").contains("s3cret-pw"));

        write(
            dir.path(),
            "open",
            "username = \"a\"\npassword = \"b\"\n",
            0o644,
        );
        let e = secrets.credentials("open").unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");

        write(
            dir.path(),
            "bad",
            "password = \"leak-me\"\nuser = 1\n",
            0o600,
        );
        let e = secrets.credentials("bad").unwrap_err().to_string();
        assert!(
            !e.contains("leak-me") && e.contains("username and password"),
            "{e}"
        );

        std::os::unix::fs::symlink(dir.path().join("rack12"), dir.path().join("link")).unwrap();
        assert!(secrets.credentials("link").is_err());
        for name in ["../etc/passwd", ".hidden", "", "a/b"] {
            assert!(matches!(
                secrets.credentials(name),
                Err(SecretError::BadName(_))
            ));
        }
        assert!(
            secrets
                .credentials("missing")
                .unwrap_err()
                .to_string()
                .contains("cannot open")
        );
    }
}
