//! TFTP option negotiation (RFC 2347 OACK, 2348 blksize, 2349 timeout/tsize, 7440
//! windowsize): pure, from the options a client asked for to the ones we accept.

use std::time::Duration;

pub const DEFAULT_BLKSIZE: u16 = 512;
pub const MIN_BLKSIZE: u16 = 8;
pub const MAX_BLKSIZE: u16 = 65464;

/// What we accept at most; configurable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionLimits {
    pub max_blksize: u16,
    pub max_windowsize: u16,
}

impl Default for OptionLimits {
    fn default() -> Self {
        Self {
            max_blksize: MAX_BLKSIZE,
            max_windowsize: 64,
        }
    }
}

/// The transfer parameters agreed, and the OACK to send (empty: send no OACK, start
/// with DATA 1, as RFC 2347 requires when no option was accepted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    pub blksize: u16,
    pub windowsize: u16,
    pub timeout: Option<Duration>,
    pub oack: Vec<(String, String)>,
}

/// Unknown or malformed options are left out of the OACK (the client then runs without
/// them), never an error: old ROMs send odd options and must still boot.
pub fn negotiate(
    requested: &[(String, String)],
    file_len: u64,
    limits: OptionLimits,
) -> Negotiated {
    let mut n = Negotiated {
        blksize: DEFAULT_BLKSIZE,
        windowsize: 1,
        timeout: None,
        oack: Vec::new(),
    };
    for (name, value) in requested {
        let number = value.trim().parse::<u64>().ok();
        match (name.as_str(), number) {
            ("blksize", Some(v)) if v >= MIN_BLKSIZE as u64 => {
                n.blksize = v.min(limits.max_blksize.min(MAX_BLKSIZE) as u64) as u16;
                n.oack.push((name.clone(), n.blksize.to_string()));
            }
            ("timeout", Some(v)) if (1..=255).contains(&v) => {
                n.timeout = Some(Duration::from_secs(v));
                n.oack.push((name.clone(), v.to_string()));
            }
            ("tsize", Some(_)) => n.oack.push((name.clone(), file_len.to_string())),
            ("windowsize", Some(v)) if v >= 1 => {
                n.windowsize = v.min(limits.max_windowsize.max(1) as u64) as u16;
                n.oack.push((name.clone(), n.windowsize.to_string()));
            }
            _ => {}
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn check(requested: &[(&str, &str)], blksize: u16, window: u16, oack: &[(&str, &str)]) {
        let n = negotiate(&opts(requested), 1000, OptionLimits::default());
        assert_eq!(
            (n.blksize, n.windowsize),
            (blksize, window),
            "{requested:?}"
        );
        assert_eq!(n.oack, opts(oack), "{requested:?}");
    }

    #[test]
    fn negotiates() {
        check(&[], 512, 1, &[]);
        // EDK2's request.
        check(
            &[("blksize", "1468"), ("windowsize", "4"), ("tsize", "0")],
            1468,
            4,
            &[("blksize", "1468"), ("windowsize", "4"), ("tsize", "1000")],
        );
        check(&[("blksize", "70000")], 65464, 1, &[("blksize", "65464")]);
        check(&[("blksize", "7")], 512, 1, &[]);
        check(&[("blksize", "abc")], 512, 1, &[]);
        check(&[("windowsize", "1000")], 512, 64, &[("windowsize", "64")]);
        check(&[("windowsize", "0")], 512, 1, &[]);
        check(&[("timeout", "0")], 512, 1, &[]);
        check(&[("timeout", "3")], 512, 1, &[("timeout", "3")]);
        check(&[("multicast", "")], 512, 1, &[]);
    }
}
