//! The TPM 2.0 structures that evidence carries (TPM 2.0 Part 2), read from the exact
//! bytes the TPM produced: public areas (TPMT_PUBLIC), quotes (TPMS_ATTEST) and
//! signatures (TPMT_SIGNATURE). Everything hashed or verified is the received bytes,
//! never a re-encoding.
//!
//! Read by hand with a bounded reader rather than with `tpm2-protocol` (checked at 1.2.3):
//! the three layouts are fixed and small, only RSA keys are accepted for now, and the
//! crate's generic buffer types and young API (0.8 to 1.x within a year) would cost more
//! to pin and wrap than these hundred lines.

/// TPM_ALG_ID values used here.
pub mod alg {
    pub const RSA: u16 = 0x0001;
    pub const SHA256: u16 = 0x000b;
    pub const AES: u16 = 0x0006;
    pub const CFB: u16 = 0x0043;
    pub const NULL: u16 = 0x0010;
    pub const RSASSA: u16 = 0x0014;
}

/// TPMA_OBJECT bits.
pub mod attr {
    pub const FIXED_TPM: u32 = 1 << 1;
    pub const FIXED_PARENT: u32 = 1 << 4;
    pub const SENSITIVE_DATA_ORIGIN: u32 = 1 << 5;
    pub const ADMIN_WITH_POLICY: u32 = 1 << 7;
    pub const RESTRICTED: u32 = 1 << 16;
    pub const DECRYPT: u32 = 1 << 17;
    pub const SIGN: u32 = 1 << 18;
}

/// TPM_GENERATED_VALUE: the TPM made this structure itself.
const GENERATED: u32 = 0xff54_4347;
/// TPM_ST_ATTEST_QUOTE.
const ST_ATTEST_QUOTE: u16 = 0x8018;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("{0}: truncated")]
    Truncated(&'static str),
    #[error("{0}: {1} trailing bytes")]
    Trailing(&'static str, usize),
    #[error("{0}")]
    Unsupported(String),
}

/// A bounded big-endian reader: every read names what it was reading when it ran out.
struct Reader<'a> {
    what: &'static str,
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(what: &'static str, bytes: &'a [u8]) -> Self {
        Reader { what, rest: bytes }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.rest.len() < n {
            return Err(WireError::Truncated(self.what));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_be_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    /// A TPM2B: a u16 size, then that many bytes.
    fn sized(&mut self) -> Result<&'a [u8], WireError> {
        let n = self.u16()? as usize;
        self.take(n)
    }
    fn end(&self) -> Result<(), WireError> {
        match self.rest.len() {
            0 => Ok(()),
            n => Err(WireError::Trailing(self.what, n)),
        }
    }
}

/// An RSA public area as the TPM gave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Public {
    /// The TPMT_PUBLIC bytes, as received.
    pub area: Vec<u8>,
    pub attributes: u32,
    pub auth_policy: Vec<u8>,
    /// The symmetric algorithm of a storage key (AES-128-CFB for an EK), else None.
    pub symmetric: Option<(u16, u16, u16)>,
    /// The signing scheme and its hash, for a signing key with a fixed scheme.
    pub scheme: Option<(u16, u16)>,
    pub key_bits: u16,
    pub exponent: u32,
    pub modulus: Vec<u8>,
}

impl Public {
    /// Reads a TPM2B_PUBLIC (what `tpm2_readpublic -f tss` and the agent send).
    pub fn from_tpm2b(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new("TPM2B_PUBLIC", bytes);
        let area = r.sized()?;
        r.end()?;
        Self::from_area(area)
    }

    /// Reads a TPMT_PUBLIC: RSA keys named with SHA-256 only.
    pub fn from_area(area: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new("TPMT_PUBLIC", area);
        let kind = r.u16()?;
        if kind != alg::RSA {
            return Err(WireError::Unsupported(format!(
                "key type 0x{kind:04x}: only RSA keys are accepted"
            )));
        }
        let name_alg = r.u16()?;
        if name_alg != alg::SHA256 {
            return Err(WireError::Unsupported(format!(
                "name algorithm 0x{name_alg:04x}: only SHA-256 names are accepted"
            )));
        }
        let attributes = r.u32()?;
        let auth_policy = r.sized()?.to_vec();
        let symmetric = match r.u16()? {
            alg::NULL => None,
            a => Some((a, r.u16()?, r.u16()?)),
        };
        let scheme = match r.u16()? {
            alg::NULL => None,
            s => Some((s, r.u16()?)),
        };
        let key_bits = r.u16()?;
        let exponent = match r.u32()? {
            0 => 65537, // the TPM's way of saying the default exponent
            e => e,
        };
        let modulus = r.sized()?.to_vec();
        r.end()?;
        Ok(Public {
            area: area.to_vec(),
            attributes,
            auth_policy,
            symmetric,
            scheme,
            key_bits,
            exponent,
            modulus,
        })
    }

    /// The object's Name: nameAlg ‖ SHA-256(TPMT_PUBLIC).
    pub fn name(&self) -> Vec<u8> {
        use sha2::Digest as _;
        let mut name = alg::SHA256.to_be_bytes().to_vec();
        name.extend_from_slice(&sha2::Sha256::digest(&self.area));
        name
    }

    /// The modulus and exponent as a DER RSAPublicKey (PKCS#1), as ring verifies with.
    pub fn rsa_public_key_der(&self) -> Vec<u8> {
        fn int(bytes: &[u8]) -> Vec<u8> {
            let trimmed: &[u8] = {
                let first = bytes.iter().position(|b| *b != 0).unwrap_or(bytes.len());
                &bytes[first..]
            };
            let mut v = Vec::with_capacity(trimmed.len() + 1);
            if trimmed.first().is_none_or(|b| b & 0x80 != 0) {
                v.push(0);
            }
            v.extend_from_slice(trimmed);
            der(0x02, &v)
        }
        let mut body = int(&self.modulus);
        body.extend(int(&self.exponent.to_be_bytes()));
        der(0x30, &body)
    }
}

/// One DER TLV.
fn der(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    let n = body.len();
    if n < 0x80 {
        out.push(n as u8);
    } else {
        let len = n.to_be_bytes();
        let first = len.iter().position(|b| *b != 0).unwrap_or(len.len() - 1);
        out.push(0x80 | (len.len() - first) as u8);
        out.extend_from_slice(&len[first..]);
    }
    out.extend_from_slice(body);
    out
}

/// What a quote says, read from the TPMS_ATTEST the TPM signed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quote {
    /// The qualifying data the caller asked to be signed (our nonce).
    pub extra_data: Vec<u8>,
    /// The TPM's reset count: a reboot of the node moves it.
    pub reset_count: u32,
    /// Quoted PCRs per bank: (hash algorithm, PCR indices in ascending order).
    pub selection: Vec<(u16, Vec<u8>)>,
    /// The digest of the quoted PCR values, concatenated in selection order.
    pub pcr_digest: Vec<u8>,
}

impl Quote {
    pub fn parse(attest: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new("TPMS_ATTEST", attest);
        if r.u32()? != GENERATED {
            return Err(WireError::Unsupported(
                "not made by a TPM (magic is not TPM_GENERATED_VALUE)".into(),
            ));
        }
        let kind = r.u16()?;
        if kind != ST_ATTEST_QUOTE {
            return Err(WireError::Unsupported(format!(
                "attestation type 0x{kind:04x}, not a quote"
            )));
        }
        r.sized()?; // qualifiedSigner
        let extra_data = r.sized()?.to_vec();
        r.take(8)?; // clock
        let reset_count = r.u32()?;
        r.take(4 + 1)?; // restartCount, safe
        r.take(8)?; // firmwareVersion
        let banks = r.u32()?;
        if banks > 16 {
            return Err(WireError::Unsupported(format!("{banks} PCR banks")));
        }
        let mut selection = Vec::new();
        for _ in 0..banks {
            let hash = r.u16()?;
            let size = r.u8()? as usize;
            let bits = r.take(size)?;
            let pcrs = (0..size * 8)
                .filter(|i| bits[i / 8] & (1 << (i % 8)) != 0)
                .map(|i| i as u8)
                .collect();
            selection.push((hash, pcrs));
        }
        let pcr_digest = r.sized()?.to_vec();
        r.end()?;
        Ok(Quote {
            extra_data,
            reset_count,
            selection,
            pcr_digest,
        })
    }
}

/// An RSASSA signature (PKCS#1 v1.5) with its hash, from a TPMT_SIGNATURE.
pub fn rsassa_signature(bytes: &[u8]) -> Result<(u16, Vec<u8>), WireError> {
    let mut r = Reader::new("TPMT_SIGNATURE", bytes);
    let sig_alg = r.u16()?;
    if sig_alg != alg::RSASSA {
        return Err(WireError::Unsupported(format!(
            "signature algorithm 0x{sig_alg:04x}: only RSASSA is accepted"
        )));
    }
    let hash = r.u16()?;
    let sig = r.sized()?.to_vec();
    r.end()?;
    Ok((hash, sig))
}

/// The credential blob the agent hands to `tpm2_activatecredential -i`: tpm2-tools'
/// file header, then TPM2B_ID_OBJECT and TPM2B_ENCRYPTED_SECRET.
pub fn credential_blob(id_object: &[u8], encrypted_secret: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + id_object.len() + encrypted_secret.len());
    out.extend_from_slice(&0xBADC_C0DEu32.to_be_bytes());
    out.extend_from_slice(&1u32.to_be_bytes());
    for part in [id_object, encrypted_secret] {
        out.extend_from_slice(&(part.len() as u16).to_be_bytes());
        out.extend_from_slice(part);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn der_lengths_use_the_short_and_long_forms() {
        assert_eq!(der(0x02, &[1]), vec![0x02, 1, 1]);
        let long = der(0x04, &[0; 300]);
        assert_eq!(&long[..4], &[0x04, 0x82, 0x01, 0x2c]);
    }

    #[test]
    fn a_truncated_quote_names_the_structure() {
        let err = Quote::parse(&[0xff, 0x54, 0x43, 0x47, 0x80]).unwrap_err();
        assert_eq!(err, WireError::Truncated("TPMS_ATTEST"));
        let err = Quote::parse(&[0, 0, 0, 0, 0x80, 0x18]).unwrap_err();
        assert!(err.to_string().contains("magic"), "{err}");
    }

    #[test]
    fn an_ecc_key_is_refused_by_name() {
        let area = [0x00, 0x23, 0x00, 0x0b];
        let err = Public::from_area(&area).unwrap_err();
        assert!(err.to_string().contains("only RSA"), "{err}");
    }
}
