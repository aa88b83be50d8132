//! The admin bearer token: generated on first start (mode 0600), compared in constant time.

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

/// The console's session cookie and its CSRF token, both derived from the admin token
/// (HMAC-SHA256), so no session is stored: every server sharing the token accepts them,
/// and changing the token ends every session. The cookie is `<expiry ms>.<hex MAC>`; it
/// travels HttpOnly and SameSite=Strict, and a request that changes anything must also
/// carry the CSRF token in a header, which a cross-site form cannot set.
pub mod session {
    use hmac::{Hmac, Mac as _};
    use sha2::Sha256;
    use subtle::ConstantTimeEq;

    use super::AdminToken;

    pub const COOKIE: &str = "bootfleet_session";
    pub const CSRF_HEADER: &str = "x-bootfleet-csrf";
    /// How long a login lasts.
    pub const LIFETIME_MS: i64 = 12 * 3600 * 1000;

    fn mac(token: &AdminToken, purpose: &str, value: &str) -> String {
        let mut m = Hmac::<Sha256>::new_from_slice(token.secret().as_bytes())
            .expect("HMAC takes any key length");
        m.update(purpose.as_bytes());
        m.update(b"\0");
        m.update(value.as_bytes());
        hex::encode(m.finalize().into_bytes())
    }

    /// A session that ends at `expires_ms`.
    pub fn issue(token: &AdminToken, expires_ms: i64) -> String {
        format!(
            "{expires_ms}.{}",
            mac(token, "session", &expires_ms.to_string())
        )
    }

    /// Whether `cookie` is a session this token issued and it has not expired.
    pub fn valid(token: &AdminToken, cookie: &str, now_ms: i64) -> bool {
        let Some((expires, sig)) = cookie.split_once('.') else {
            return false;
        };
        let Ok(expires_ms) = expires.parse::<i64>() else {
            return false;
        };
        let want = mac(token, "session", expires);
        expires_ms > now_ms && bool::from(want.as_bytes().ct_eq(sig.as_bytes()))
    }

    /// The CSRF token that goes with a session.
    pub fn csrf(token: &AdminToken, cookie: &str) -> String {
        mac(token, "csrf", cookie)
    }

    pub fn csrf_matches(token: &AdminToken, cookie: &str, presented: &str) -> bool {
        csrf(token, cookie)
            .as_bytes()
            .ct_eq(presented.as_bytes())
            .into()
    }

    /// The session cookie's value in a `Cookie` header, if there is one.
    pub fn from_header(cookie_header: &str) -> Option<&str> {
        cookie_header.split(';').find_map(|c| {
            let (k, v) = c.trim().split_once('=')?;
            (k == COOKIE).then_some(v)
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_session_is_valid_until_it_expires_and_only_for_its_token() {
            let t = AdminToken::new("a-token-of-sixteen-plus".into());
            let s = issue(&t, 10_000);
            assert!(valid(&t, &s, 9_999));
            assert!(!valid(&t, &s, 10_000), "expired");
            let other = AdminToken::new("another-token-sixteen".into());
            assert!(!valid(&other, &s, 0), "another token's session");
            let forged = s.replacen("10000", "99999", 1);
            assert!(!valid(&t, &forged, 0), "a moved expiry breaks the MAC");
            assert!(!valid(&t, "garbage", 0));
            let csrf = csrf(&t, &s);
            assert!(csrf_matches(&t, &s, &csrf));
            assert!(!csrf_matches(&t, &s, "0000"));
            assert_ne!(
                csrf,
                s.split_once('.').unwrap().1,
                "the CSRF token is not the cookie"
            );
        }

        #[test]
        fn the_cookie_is_found_among_others() {
            assert_eq!(
                from_header("a=1; bootfleet_session=5.ab; b=2"),
                Some("5.ab")
            );
            assert_eq!(from_header("a=1"), None);
        }
    }
}
