//! Normalisation of relative paths: the one gate that keeps names inside their root,
//! for bundle entries and for the files TFTP and `/ipxe` serve.

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PathError {
    #[error("absolute paths are not allowed")]
    Absolute,
    #[error("'..' is not allowed")]
    ParentDir,
    #[error("backslashes and control characters are not allowed")]
    BadCharacter,
    #[error("path is empty")]
    Empty,
    #[error("path is longer than {0} bytes")]
    TooLong(usize),
}

pub const MAX_PATH_LEN: usize = 1024;

/// Returns the canonical spelling of a relative path (`./a//b` -> `a/b`), or why it is refused.
pub fn normalize_path(p: &str) -> Result<String, PathError> {
    normalize_path_within(p, MAX_PATH_LEN)
}

/// `normalize_path` with a length limit of `max_len` bytes.
pub fn normalize_path_within(p: &str, max_len: usize) -> Result<String, PathError> {
    if p.len() > max_len {
        return Err(PathError::TooLong(max_len));
    }
    if p.starts_with('/') {
        return Err(PathError::Absolute);
    }
    if p.chars().any(|c| c == '\\' || c.is_control()) {
        return Err(PathError::BadCharacter);
    }
    let mut parts = Vec::new();
    for part in p.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err(PathError::ParentDir),
            other => parts.push(other),
        }
    }
    if parts.is_empty() {
        return Err(PathError::Empty);
    }
    Ok(parts.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(input: &str, expected: Result<&str, PathError>) {
        assert_eq!(
            normalize_path(input),
            expected.map(String::from),
            "{input:?}"
        );
    }

    #[test]
    fn normalises_or_refuses() {
        check("vmlinuz", Ok("vmlinuz"));
        check("./boot//vmlinuz", Ok("boot/vmlinuz"));
        check("boot/./x/", Ok("boot/x"));
        check("../x", Err(PathError::ParentDir));
        check("a/../../x", Err(PathError::ParentDir));
        check("/etc/passwd", Err(PathError::Absolute));
        check("a\\b", Err(PathError::BadCharacter));
        check("a\nb", Err(PathError::BadCharacter));
        check("./", Err(PathError::Empty));
        check(&"a".repeat(2000), Err(PathError::TooLong(MAX_PATH_LEN)));
    }
}
