//! Image names, versions, tags and the REF syntax admins type (digest, name:version, name:tag).

use std::fmt;

use crate::digest::Digest;

/// What a user may type to name an image.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ImageRef {
    Digest(Digest),
    /// `sha256:` and the first 8 to 63 hex digits of a digest: the one image whose digest
    /// begins so, refused when several do.
    DigestPrefix(String),
    /// `name:label`, where label is a version or a tag; versions win (see `store`).
    Named {
        name: String,
        label: String,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RefError {
    #[error(
        "invalid image name {0:?}: use 1-128 characters from a-z, 0-9, '.', '_', '-', starting with a letter or digit"
    )]
    Name(String),
    #[error(
        "invalid {kind} {value:?}: use 1-128 characters from A-Z, a-z, 0-9, '.', '_', '+', '-', starting with a letter or digit"
    )]
    Label { kind: &'static str, value: String },
    #[error(
        "invalid image reference {0:?}: expected sha256:<hex> (64 digits, or at least 8 of its first), NAME:VERSION or NAME:TAG"
    )]
    Ref(String),
}

fn is_valid_name(s: &str) -> bool {
    (1..=128).contains(&s.len())
        && s.as_bytes()[0].is_ascii_alphanumeric()
        && s.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
        })
}

fn is_valid_label(s: &str) -> bool {
    (1..=128).contains(&s.len())
        && s.as_bytes()[0].is_ascii_alphanumeric()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'+' | b'-'))
}

pub fn check_name(s: &str) -> Result<(), RefError> {
    is_valid_name(s)
        .then_some(())
        .ok_or_else(|| RefError::Name(s.to_string()))
}

pub fn check_label(kind: &'static str, s: &str) -> Result<(), RefError> {
    is_valid_label(s)
        .then_some(())
        .ok_or_else(|| RefError::Label {
            kind,
            value: s.to_string(),
        })
}

/// A host name by RFC 1123: dot-separated parts of 1 to 63 letters, digits and hyphens
/// (not at either end of a part), at most 253 characters.
pub fn is_hostname(name: &str) -> bool {
    (1..=253).contains(&name.len())
        && name.split('.').all(|part| {
            (1..=63).contains(&part.len())
                && !part.starts_with('-')
                && !part.ends_with('-')
                && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// A movable pointer `name:tag`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagName {
    pub name: String,
    pub tag: String,
}

impl TagName {
    pub fn parse(s: &str) -> Result<Self, RefError> {
        let (name, tag) = s.split_once(':').ok_or_else(|| RefError::Label {
            kind: "tag (expected NAME:TAG)",
            value: s.to_string(),
        })?;
        check_name(name)?;
        check_label("tag", tag)?;
        Ok(Self {
            name: name.to_string(),
            tag: tag.to_string(),
        })
    }
}

impl fmt::Display for TagName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.name, self.tag)
    }
}

/// The fewest hex digits a digest prefix may have.
pub const MIN_DIGEST_PREFIX: usize = 8;

impl ImageRef {
    pub fn parse(s: &str) -> Result<Self, RefError> {
        if let Some(hex) = s.strip_prefix("sha256:") {
            if (MIN_DIGEST_PREFIX..64).contains(&hex.len())
                && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
            {
                return Ok(ImageRef::DigestPrefix(hex.to_string()));
            }
            return s
                .parse()
                .map(ImageRef::Digest)
                .map_err(|_| RefError::Ref(s.to_string()));
        }
        let (name, label) = s
            .split_once(':')
            .ok_or_else(|| RefError::Ref(s.to_string()))?;
        check_name(name)?;
        check_label("version or tag", label)?;
        Ok(ImageRef::Named {
            name: name.to_string(),
            label: label.to_string(),
        })
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageRef::Digest(d) => d.fmt(f),
            ImageRef::DigestPrefix(p) => write!(f, "sha256:{p}"),
            ImageRef::Named { name, label } => write!(f, "{name}:{label}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(input: &str, ok: bool) {
        assert_eq!(ImageRef::parse(input).is_ok(), ok, "{input}");
    }

    #[test]
    fn refs() {
        check("gpu-node:2026.12.0", true);
        check("gpu-node:stable", true);
        check(&format!("sha256:{}", "a".repeat(64)), true);
        check("sha256:abc", false);
        check("sha256:0123abcd", true);
        check("sha256:0123ABCD", false);
        check("sha256:0123abcg", false);
        assert_eq!(
            ImageRef::parse("sha256:0123abcd9"),
            Ok(ImageRef::DigestPrefix("0123abcd9".into()))
        );
        assert_eq!(
            ImageRef::parse("sha256:0123abcd9").unwrap().to_string(),
            "sha256:0123abcd9"
        );
        check("gpu-node", false);
        check("GPU:1", false);
        check("gpu:", false);
        check(":1", false);
        check("gpu:1/2", false);
        check("../x:1", false);
        check("gpu:-1", false);
    }

    #[test]
    fn tags() {
        assert_eq!(
            TagName::parse("gpu-node:stable").unwrap().to_string(),
            "gpu-node:stable"
        );
        assert!(TagName::parse("gpu-node").is_err());
        assert!(TagName::parse("gpu-node:st able").is_err());
    }
}
