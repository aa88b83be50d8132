//! `Mac`: a typed Ethernet address, parsed from the spellings firmware and admins use.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Mac([u8; 6]);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid MAC address {0:?}: expected six hex pairs separated by ':' or '-'")]
pub struct MacError(String);

impl Mac {
    pub fn octets(&self) -> [u8; 6] {
        self.0
    }
}

impl From<[u8; 6]> for Mac {
    fn from(octets: [u8; 6]) -> Self {
        Mac(octets)
    }
}

impl FromStr for Mac {
    type Err = MacError;
    /// Accepts `52:54:00:12:34:56` and iPXE's `${mac:hexhyp}` form `52-54-00-12-34-56`,
    /// any case; one separator throughout, two hex digits a pair (no sign, no space).
    fn from_str(s: &str) -> Result<Self, MacError> {
        let err = || MacError(s.to_string());
        let separator = if s.contains(':') { ':' } else { '-' };
        let parts: Vec<&str> = s.split(separator).collect();
        if parts.len() != 6 {
            return Err(err());
        }
        let mut out = [0u8; 6];
        for (o, p) in out.iter_mut().zip(parts) {
            if p.len() != 2 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(err());
            }
            *o = u8::from_str_radix(p, 16).map_err(|_| err())?;
        }
        Ok(Mac(out))
    }
}

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        // `pad`, so that a width in the format (`{:<18}`) lines columns up.
        f.pad(&format!("{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}"))
    }
}

impl fmt::Debug for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Serialize for Mac {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Mac {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_spellings_and_refuses_others() {
        let m: Mac = "52-54-00-AB-cd-56".parse().unwrap();
        assert_eq!(m.to_string(), "52:54:00:ab:cd:56");
        assert_eq!("52:54:00:ab:cd:56".parse::<Mac>().unwrap(), m);
        for bad in [
            "",
            "52:54:00:ab:cd",
            "52:54:00:ab:cd:56:78",
            "5:54:00:ab:cd:56",
            "zz:54:00:ab:cd:56",
            "525400abcd56",
            "52:54-00:ab:cd:56",
            "+2:54:00:ab:cd:56",
            "52:54:00:ab:cd:+6",
        ] {
            assert!(bad.parse::<Mac>().is_err(), "{bad}");
        }
        assert_eq!(format!("{m:<19}|"), "52:54:00:ab:cd:56  |");
    }
}
