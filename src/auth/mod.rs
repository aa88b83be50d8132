//! Who may call the admin API: the first-start admin token (generated, mode 0600,
//! compared in constant time), named tokens with a role (`tokens`, `roles`), the
//! console's sessions (`session`), and a limit on failed attempts per source (`limiter`).

pub mod limiter;
pub mod roles;
pub mod session;
pub mod tokens;

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use subtle::ConstantTimeEq;

pub const TOKEN_FILE_NAME: &str = "admin.token";

#[derive(Clone)]
pub struct AdminToken(String);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(..)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read admin token file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write admin token file {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("admin token file {0} is empty or shorter than 16 characters")]
    TooShort(PathBuf),
}

impl AdminToken {
    pub fn new(secret: String) -> Self {
        Self(secret)
    }

    /// Reads `configured` if given; else reads `<data_dir>/admin.token`, creating it with
    /// a fresh random token (mode 0600, written atomically) when absent.
    pub fn load_or_create(configured: Option<&Path>, data_dir: &Path) -> Result<Self, TokenError> {
        if let Some(path) = configured {
            return Self::read(path);
        }
        let path = data_dir.join(TOKEN_FILE_NAME);
        if path.exists() {
            return Self::read(&path);
        }
        let secret = hex::encode(rand::random::<[u8; 32]>());
        write_private_atomically(&path, secret.as_bytes()).map_err(|source| TokenError::Write {
            path: path.clone(),
            source,
        })?;
        tracing::info!(path = %path.display(), "generated a new admin token");
        Ok(Self(secret))
    }

    pub fn read(path: &Path) -> Result<Self, TokenError> {
        let text = fs::read_to_string(path).map_err(|source| TokenError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let secret = text.trim().to_string();
        if secret.len() < 16 {
            return Err(TokenError::TooShort(path.to_path_buf()));
        }
        Ok(Self(secret))
    }

    pub fn secret(&self) -> &str {
        &self.0
    }

    /// Constant-time comparison, so response timing reveals nothing of the token.
    pub fn matches(&self, presented: &str) -> bool {
        self.0.as_bytes().ct_eq(presented.as_bytes()).into()
    }
}

fn write_private_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".tmp-token-{:016x}", rand::random::<u64>()));
    let result = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn generates_once_private_and_matches() {
        let dir = tempfile::tempdir().unwrap();
        let t1 = AdminToken::load_or_create(None, dir.path()).unwrap();
        let t2 = AdminToken::load_or_create(None, dir.path()).unwrap();
        assert_eq!(t1.secret(), t2.secret());
        assert_eq!(t1.secret().len(), 64);
        let mode = fs::metadata(dir.path().join(TOKEN_FILE_NAME))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(t1.matches(t2.secret()));
        assert!(!t1.matches("nope"));
        assert!(!t1.matches(""));
    }
}
