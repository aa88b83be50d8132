//! The console's session cookie and its CSRF token, both derived from the admin token
//! (HMAC-SHA256), so no session is stored: every server sharing the token accepts them,
//! and changing the token ends every session. The cookie is `<expiry ms>.<name>.<hex
//! MAC>`, `name` the API token that logged in (`admin` for the admin token), whose role
//! the session then has (and which ends it when revoked: the gate looks the name up).
//! It travels HttpOnly and SameSite=Strict, and a request that changes anything must
//! also carry the CSRF token in a header, which a cross-site form cannot set.

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

/// A session of the API token `name` that ends at `expires_ms`.
pub fn issue(token: &AdminToken, name: &str, expires_ms: i64) -> String {
    let signed = format!("{expires_ms}.{name}");
    format!("{signed}.{}", mac(token, "session", &signed))
}

/// The name of the API token whose session `cookie` is, if this token issued it and it
/// has not expired.
pub fn valid<'c>(token: &AdminToken, cookie: &'c str, now_ms: i64) -> Option<&'c str> {
    // Names may hold dots; the expiry cannot, nor the hex MAC.
    let (signed, sig) = cookie.rsplit_once('.')?;
    let (expires, name) = signed.split_once('.')?;
    let expires_ms = expires.parse::<i64>().ok()?;
    let want = mac(token, "session", signed);
    (expires_ms > now_ms && bool::from(want.as_bytes().ct_eq(sig.as_bytes()))).then_some(name)
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
        let s = issue(&t, "fleet.ops", 10_000);
        assert_eq!(valid(&t, &s, 9_999), Some("fleet.ops"));
        assert_eq!(valid(&t, &s, 10_000), None, "expired");
        let other = AdminToken::new("another-token-sixteen".into());
        assert_eq!(valid(&other, &s, 0), None, "another token's session");
        let forged = s.replacen("10000", "99999", 1);
        assert_eq!(valid(&t, &forged, 0), None, "a moved expiry breaks the MAC");
        let renamed = s.replacen("fleet.ops", "admin", 1);
        assert_eq!(valid(&t, &renamed, 0), None, "so does another name");
        assert_eq!(valid(&t, "garbage", 0), None);
        assert_eq!(valid(&t, "5.x", 0), None);
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
