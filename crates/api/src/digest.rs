//! Typed sha256 digests: the identity of every blob and every image.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest as _, Sha256};

/// A sha256 digest. Displays and serialises as `sha256:<64 lowercase hex>`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest([u8; 32]);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DigestError {
    #[error("a digest is `sha256:` followed by 64 lowercase hex digits, got {0:?}")]
    Malformed(String),
}

impl Digest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }

    pub fn from_hasher(hasher: Sha256) -> Self {
        Self(hasher.finalize().into())
    }

    /// Parses exactly 64 lowercase hex digits (no prefix). Uppercase is refused so
    /// that one digest has one spelling everywhere (paths, URLs, database keys).
    pub fn from_hex(hex_digits: &str) -> Result<Self, DigestError> {
        let malformed = || DigestError::Malformed(hex_digits.to_string());
        if hex_digits.len() != 64
            || !hex_digits
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(malformed());
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(hex_digits, &mut out).map_err(|_| malformed())?;
        Ok(Self(out))
    }

    /// The 64 hex digits, without the `sha256:` prefix.
    pub fn hex(&self) -> String {
        self.hex_digits().to_string()
    }

    /// The hex digits on the stack: a digest is formatted for every blob response's ETag
    /// and every row that names one, and `hex::encode` goes a char at a time into a
    /// `String` of its own.
    fn hex_digits(&self) -> HexDigits {
        let mut digits = [0u8; 64];
        hex::encode_to_slice(self.0, &mut digits).expect("64 digits for 32 bytes");
        HexDigits(digits)
    }
}

/// A digest's 64 hex digits.
struct HexDigits([u8; 64]);

impl std::ops::Deref for HexDigits {
    type Target = str;
    fn deref(&self) -> &str {
        std::str::from_utf8(&self.0).expect("hex digits are ASCII")
    }
}

impl FromStr for Digest {
    type Err = DigestError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.strip_prefix("sha256:") {
            Some(hex_digits) => Self::from_hex(hex_digits),
            None => Err(DigestError::Malformed(s.to_string())),
        }
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("sha256:")?;
        f.write_str(&self.hex_digits())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Serialize for Digest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_bad_spellings() {
        let d = Digest::of(b"hello");
        let text = d.to_string();
        assert_eq!(
            text,
            "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        );
        assert_eq!(text.parse::<Digest>().unwrap(), d);
        assert_eq!(d.hex(), text["sha256:".len()..]);
        for bad in [
            "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
            "sha256:2CF24DBA5FB0A30E26E83B2AC5B9E29E1B161E5C1FA7425E73043362938B9824",
            "sha256:2cf24d",
            "sha512:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
            "sha256:zzf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
            "",
        ] {
            assert!(bad.parse::<Digest>().is_err(), "{bad} should be refused");
        }
    }
}
