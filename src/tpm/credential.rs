//! MakeCredential (TPM 2.0 Part 1 §24, Part 3 TPM2_MakeCredential) done by the server in
//! software: a secret that only the TPM holding the endorsement key can recover, and
//! only for the attestation key named. A node that answers with a quote bound to the
//! secret proves its AK lives in the TPM whose EK we enrolled.
//!
//! seed → RSA-OAEP(EK, label "IDENTITY\0"); symKey = KDFa(seed, "STORAGE", AK name);
//! encIdentity = AES-128-CFB(symKey, IV 0, TPM2B(secret)); hmacKey = KDFa(seed,
//! "INTEGRITY"); integrity = HMAC(hmacKey, encIdentity ‖ AK name).
//! No crate offers this without linking libtss2 (tss-esapi's pure version is only in an
//! 8.0 alpha): it is built from the RustCrypto primitives, and checked against a real
//! TPM's ActivateCredential in the tests.

use aes::cipher::{AsyncStreamCipher, KeyIvInit};
use hmac::{Hmac, Mac as _};
use sha2::Sha256;

use super::wire::{Public, attr};

#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    #[error("the endorsement key is not a restricted decryption key with AES-128-CFB")]
    NotAnEk,
    #[error("the endorsement key's modulus cannot encrypt: {0}")]
    Rsa(String),
}

/// TPM2_MakeCredential's output, as TPM2_ActivateCredential takes it.
pub struct Credential {
    /// TPM2B_ID_OBJECT's contents: TPM2B(integrity HMAC) ‖ encIdentity.
    pub id_object: Vec<u8>,
    /// TPM2B_ENCRYPTED_SECRET's contents: the seed under the EK.
    pub encrypted_secret: Vec<u8>,
}

/// Makes a credential carrying `secret` (at most 32 bytes) for the key named `ak_name`,
/// openable only by the TPM holding `ek`.
pub fn make(ek: &Public, ak_name: &[u8], secret: &[u8]) -> Result<Credential, CredentialError> {
    let wanted = attr::RESTRICTED | attr::DECRYPT;
    if ek.attributes & wanted != wanted
        || ek.attributes & attr::SIGN != 0
        || ek.symmetric != Some((super::wire::alg::AES, 128, super::wire::alg::CFB))
    {
        return Err(CredentialError::NotAnEk);
    }
    let mut seed = [0u8; 32];
    rand::fill(&mut seed);
    let encrypted_secret = oaep_identity(ek, &seed)?;
    Ok(wrap(&seed, ak_name, secret, encrypted_secret))
}

/// The symmetric half, from a given seed (separate for known-answer tests).
fn wrap(seed: &[u8; 32], ak_name: &[u8], secret: &[u8], encrypted_secret: Vec<u8>) -> Credential {
    let sym_key = kdfa(seed, b"STORAGE", ak_name, b"", 128);
    let mut enc_identity = (secret.len() as u16).to_be_bytes().to_vec();
    enc_identity.extend_from_slice(secret);
    cfb_mode::Encryptor::<aes::Aes128>::new_from_slices(&sym_key, &[0u8; 16])
        .expect("a 16-byte key and IV")
        .encrypt(&mut enc_identity);
    let hmac_key = kdfa(seed, b"INTEGRITY", b"", b"", 256);
    let mut mac = <Hmac<Sha256>>::new_from_slice(&hmac_key).expect("any key length");
    mac.update(&enc_identity);
    mac.update(ak_name);
    let integrity = mac.finalize().into_bytes();
    let mut id_object = (integrity.len() as u16).to_be_bytes().to_vec();
    id_object.extend_from_slice(&integrity);
    id_object.extend_from_slice(&enc_identity);
    Credential {
        id_object,
        encrypted_secret,
    }
}

/// RSA-OAEP with SHA-256 and the label "IDENTITY\0" under the EK's public key.
fn oaep_identity(ek: &Public, seed: &[u8]) -> Result<Vec<u8>, CredentialError> {
    use rsa::{BigUint, Oaep, RsaPublicKey};
    let key = RsaPublicKey::new(
        BigUint::from_bytes_be(&ek.modulus),
        BigUint::from(ek.exponent),
    )
    .map_err(|e| CredentialError::Rsa(e.to_string()))?;
    key.encrypt(
        &mut rsa::rand_core::OsRng,
        Oaep::new_with_label::<Sha256, _>("IDENTITY\0"),
        seed,
    )
    .map_err(|e| CredentialError::Rsa(e.to_string()))
}

/// KDFa with HMAC-SHA-256 (Part 1 §11.4.10.2): counter ‖ label ‖ 0 ‖ contextU ‖
/// contextV ‖ bits, big-endian counters, truncated to `bits`.
fn kdfa(key: &[u8], label: &[u8], context_u: &[u8], context_v: &[u8], bits: u32) -> Vec<u8> {
    let bytes = bits.div_ceil(8) as usize;
    let mut out = Vec::with_capacity(bytes + 32);
    let mut counter = 1u32;
    while out.len() < bytes {
        let mut mac = <Hmac<Sha256>>::new_from_slice(key).expect("any key length");
        mac.update(&counter.to_be_bytes());
        mac.update(label);
        mac.update(&[0]);
        mac.update(context_u);
        mac.update(context_v);
        mac.update(&bits.to_be_bytes());
        out.extend_from_slice(&mac.finalize().into_bytes());
        counter += 1;
    }
    out.truncate(bytes);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kdfa_is_deterministic_sized_and_label_bound() {
        let a = kdfa(b"seed", b"STORAGE", b"name", b"", 128);
        assert_eq!(a.len(), 16);
        assert_eq!(a, kdfa(b"seed", b"STORAGE", b"name", b"", 128));
        assert_ne!(a, kdfa(b"seed", b"INTEGRITY", b"name", b"", 128)[..16]);
        // A longer output extends the shorter one only in its counter blocks: the bit
        // count is part of every block, so 256 bits is not 128 bits continued.
        assert_eq!(kdfa(b"k", b"L", b"", b"", 512).len(), 64);
    }

    #[test]
    fn the_identity_object_carries_the_hmac_then_the_encrypted_secret() {
        let c = wrap(&[7; 32], b"\x00\x0bname", b"0123456789abcdef", vec![1, 2]);
        assert_eq!(&c.id_object[..2], &[0, 32]);
        // TPM2B(secret) encrypted: 2 + 16 bytes, after the 34-byte integrity.
        assert_eq!(c.id_object.len(), 34 + 18);
        // The same seed and name: the same object (the randomness is the seed's alone).
        let again = wrap(&[7; 32], b"\x00\x0bname", b"0123456789abcdef", vec![1, 2]);
        assert_eq!(c.id_object, again.id_object);
        let other = wrap(&[7; 32], b"\x00\x0bother", b"0123456789abcdef", vec![1, 2]);
        assert_ne!(c.id_object, other.id_object, "bound to the AK's name");
    }
}
