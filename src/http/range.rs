//! Pure decisions for conditional and Range requests on immutable blobs (RFC 9110).

/// What to send for a GET of a blob of `len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeDecision {
    Full,
    /// Bytes `start..=end`.
    Partial {
        start: u64,
        end: u64,
    },
    Unsatisfiable,
}

/// Decides from the `Range` and `If-Range` headers. Syntactically invalid or multi-range
/// requests get the full body, as RFC 9110 allows a server to ignore Range.
pub fn decide_range(
    range: Option<&str>,
    if_range: Option<&str>,
    etag: &str,
    len: u64,
) -> RangeDecision {
    let Some(range) = range else {
        return RangeDecision::Full;
    };
    if let Some(validator) = if_range
        && validator.trim() != etag
    {
        return RangeDecision::Full;
    }
    let Some(spec) = range.trim().strip_prefix("bytes=") else {
        return RangeDecision::Full;
    };
    if spec.contains(',') {
        return RangeDecision::Full;
    }
    let Some((first, last)) = spec.trim().split_once('-') else {
        return RangeDecision::Full;
    };
    let parse = |s: &str| s.trim().parse::<u64>().ok();
    match (first.trim().is_empty(), last.trim().is_empty()) {
        (true, true) => RangeDecision::Full,
        (true, false) => match parse(last) {
            None => RangeDecision::Full,
            Some(0) => RangeDecision::Unsatisfiable,
            Some(_) if len == 0 => RangeDecision::Unsatisfiable,
            Some(n) => RangeDecision::Partial {
                start: len - n.min(len),
                end: len - 1,
            },
        },
        (false, open_end) => {
            let Some(start) = parse(first) else {
                return RangeDecision::Full;
            };
            let end = if open_end {
                u64::MAX
            } else {
                match parse(last) {
                    Some(e) if e >= start => e,
                    _ => return RangeDecision::Full,
                }
            };
            if start >= len {
                RangeDecision::Unsatisfiable
            } else {
                RangeDecision::Partial {
                    start,
                    end: end.min(len - 1),
                }
            }
        }
    }
}

/// Whether an `If-None-Match` header value matches `etag` (weak comparison).
pub fn none_match(if_none_match: &str, etag: &str) -> bool {
    if_none_match
        .split(',')
        .map(|t| t.trim().trim_start_matches("W/"))
        .any(|t| t == "*" || t == etag)
}

#[cfg(test)]
mod tests {
    use super::RangeDecision::*;
    use super::*;

    const E: &str = "\"sha256:x\"";

    fn check(range: &str, if_range: Option<&str>, len: u64, expected: RangeDecision) {
        assert_eq!(
            decide_range(Some(range), if_range, E, len),
            expected,
            "{range} {if_range:?} {len}"
        );
    }

    #[test]
    fn ranges() {
        assert_eq!(decide_range(None, None, E, 10), Full);
        check("bytes=0-4", None, 10, Partial { start: 0, end: 4 });
        check("bytes=5-", None, 10, Partial { start: 5, end: 9 });
        check("bytes=5-100", None, 10, Partial { start: 5, end: 9 });
        check("bytes=-3", None, 10, Partial { start: 7, end: 9 });
        check("bytes=-30", None, 10, Partial { start: 0, end: 9 });
        check("bytes=10-", None, 10, Unsatisfiable);
        check("bytes=-0", None, 10, Unsatisfiable);
        check("bytes=0-", None, 0, Unsatisfiable);
        check("bytes=4-2", None, 10, Full);
        check("bytes=0-1,3-4", None, 10, Full);
        check("items=0-1", None, 10, Full);
        check("bytes=x-1", None, 10, Full);
        check("bytes=0-4", Some(E), 10, Partial { start: 0, end: 4 });
        check("bytes=0-4", Some("\"other\""), 10, Full);
    }

    #[test]
    fn etags() {
        assert!(none_match(E, E));
        assert!(none_match("\"a\", \"sha256:x\"", E));
        assert!(none_match("*", E));
        assert!(none_match("W/\"sha256:x\"", E));
        assert!(!none_match("\"a\"", E));
    }
}
