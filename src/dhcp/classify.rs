//! Who is asking, pure: from option 60 (vendor class), 93 (every architecture, RFC 4578),
//! 94 (network interface), 97 (machine UUID), 77 (user class) and 175 (iPXE), the kind
//! of network boot the client does and so the boot file it needs.

use super::wire::{Checked, decode_tlvs};

/// What kind of network boot a client does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BootClass {
    /// Legacy BIOS PXE ROM: TFTP `undionly.kpxe`.
    Bios,
    /// UEFI x86-64 PXE: TFTP iPXE EFI binary.
    UefiX64,
    /// UEFI ARM64 PXE: TFTP iPXE ARM64 EFI binary.
    UefiArm64,
    /// UEFI x86-64 HTTP boot: an `http://` URL to an EFI binary.
    HttpX64,
    /// UEFI ARM64 HTTP boot.
    HttpArm64,
    /// Already iPXE: the HTTP URL of its boot script.
    Ipxe,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Client {
    /// PXEClient or HTTPClient in option 60; None for other DHCP clients.
    pub class: Option<BootClass>,
    /// The class its firmware would have if it were not iPXE (what an iPXE client is
    /// chainloaded with); equal to `class` for other clients.
    pub firmware: Option<BootClass>,
    /// Every architecture of option 93, in order.
    pub arches: Vec<u16>,
    /// Option 97 as a UUID string, when present and not all zeros (QEMU without -uuid).
    pub uuid: Option<String>,
    /// Option 60 as sent (lossy UTF-8), to echo where firmware expects it.
    pub vendor_class: Option<String>,
}

/// RFC 4578 / IANA processor architecture types.
pub mod arch {
    pub const BIOS: u16 = 0;
    pub const EFI_IA32: u16 = 6;
    pub const EFI_BC: u16 = 7;
    pub const EFI_X64: u16 = 9;
    pub const EFI_ARM64: u16 = 11;
    pub const HTTP_X64: u16 = 16;
    pub const HTTP_ARM64: u16 = 19;
}

/// The arch from option 60 (`PXEClient:Arch:00007:UNDI:003000`), for clients without 93.
fn arch_from_vendor_class(vc: &str) -> Option<u16> {
    let mut parts = vc.split(':');
    while let Some(p) = parts.next() {
        if p == "Arch" {
            return parts.next()?.parse().ok();
        }
    }
    None
}

fn uuid(bytes: &[u8]) -> Option<String> {
    // Type byte 0, then 16 bytes (RFC 4578 2.3). The first three fields are little-endian
    // on the wire for SMBIOS >= 2.6, which is what firmware sends and `dmidecode` shows.
    let (&kind, id) = bytes.split_first()?;
    if kind != 0 || id.len() != 16 || id.iter().all(|&b| b == 0) {
        return None;
    }
    let h = |r: &[u8]| hex::encode(r);
    let rev = |r: &[u8]| hex::encode(r.iter().rev().copied().collect::<Vec<u8>>());
    Some(format!(
        "{}-{}-{}-{}-{}",
        rev(&id[0..4]),
        rev(&id[4..6]),
        rev(&id[6..8]),
        h(&id[8..10]),
        h(&id[10..16])
    ))
}

/// Whether the client is iPXE: user class `iPXE` (option 77), or iPXE's option 175.
fn is_ipxe(req: &Checked) -> bool {
    let user_class = req.option(77).unwrap_or_default();
    // RFC 3004 user class is length-prefixed instances; iPXE sends the bare string.
    let bare = user_class == b"iPXE";
    let instances = decode_instances(user_class).iter().any(|i| i == b"iPXE");
    bare || instances || req.option(175).is_some_and(|o| decode_tlvs(o).is_some())
}

fn decode_instances(mut bytes: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while let Some((&len, rest)) = bytes.split_first() {
        let Some(instance) = rest.get(..len as usize) else {
            break;
        };
        out.push(instance);
        bytes = &rest[len as usize..];
    }
    out
}

pub fn classify(req: &Checked) -> Client {
    let vendor_class = req
        .option(60)
        .map(|v| String::from_utf8_lossy(v).into_owned());
    let arches: Vec<u16> = req
        .option(93)
        .unwrap_or_default()
        .chunks_exact(2)
        .map(|c| u16::from_be_bytes([c[0], c[1]]))
        .collect();
    let vc = vendor_class.as_deref().unwrap_or("");
    let pxe = vc.starts_with("PXEClient");
    let http = vc.starts_with("HTTPClient");
    let arch = arches
        .first()
        .copied()
        .or_else(|| arch_from_vendor_class(vc));
    let firmware = if !(pxe || http) {
        None
    } else {
        match (http, arch) {
            (true, Some(arch::HTTP_ARM64 | arch::EFI_ARM64)) => Some(BootClass::HttpArm64),
            (true, _) => Some(BootClass::HttpX64),
            (false, Some(arch::BIOS) | None) => Some(BootClass::Bios),
            (false, Some(arch::EFI_ARM64)) => Some(BootClass::UefiArm64),
            (false, Some(arch::EFI_BC | arch::EFI_X64)) => Some(BootClass::UefiX64),
            (false, Some(arch::HTTP_X64)) => Some(BootClass::HttpX64),
            (false, Some(arch::HTTP_ARM64)) => Some(BootClass::HttpArm64),
            // IA32 EFI and others: no binary we ship boots them.
            (false, Some(_)) => None,
        }
    };
    let class = if (pxe || http) && is_ipxe(req) {
        Some(BootClass::Ipxe)
    } else {
        firmware
    };
    Client {
        class,
        firmware,
        arches,
        uuid: req.option(97).and_then(uuid),
        vendor_class,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dhcp::wire::{check, tests::request};

    const MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0, 1];

    fn class_of(options: &[(u8, &[u8])]) -> Option<BootClass> {
        let mut all = vec![(53u8, &[1u8][..])];
        all.extend_from_slice(options);
        classify(&check(&request(MAC, &all)).unwrap()).class
    }

    /// Option 60 strings as real firmware sent them (../shared/netboot-lab-notes.md).
    #[test]
    fn each_firmware_gets_its_class() {
        let bios = b"PXEClient:Arch:00000:UNDI:002001";
        let ovmf = b"PXEClient:Arch:00007:UNDI:003000";
        assert_eq!(
            class_of(&[(60, bios), (93, &[0, 0])]),
            Some(BootClass::Bios)
        );
        assert_eq!(
            class_of(&[(60, ovmf), (93, &[0, 7])]),
            Some(BootClass::UefiX64)
        );
        assert_eq!(
            class_of(&[(60, b"PXEClient:Arch:00011:UNDI:003000"), (93, &[0, 11])]),
            Some(BootClass::UefiArm64)
        );
        assert_eq!(
            class_of(&[(60, b"HTTPClient:Arch:00016:UNDI:003000"), (93, &[0, 16])]),
            Some(BootClass::HttpX64)
        );
        assert_eq!(
            class_of(&[(60, b"HTTPClient:Arch:00019:UNDI:003000"), (93, &[0, 19])]),
            Some(BootClass::HttpArm64)
        );
        // iPXE under BIOS or EFI: user class wins over the architecture.
        assert_eq!(
            class_of(&[(60, bios), (93, &[0, 0]), (77, b"iPXE")]),
            Some(BootClass::Ipxe)
        );
        assert_eq!(
            class_of(&[
                (60, b"PXEClient:Arch:00007:UNDI:003010"),
                (175, &[177, 5, 1, 0x11, 0x22, 0x33, 0x44])
            ]),
            Some(BootClass::Ipxe)
        );
        // Old PXE ROMs without option 93: the arch from option 60.
        assert_eq!(class_of(&[(60, ovmf)]), Some(BootClass::UefiX64));
        // Not a network-boot client (busybox udhcpc), or an arch we cannot boot.
        assert_eq!(class_of(&[(60, b"udhcp 1.35.0")]), None);
        assert_eq!(class_of(&[]), None);
        assert_eq!(
            class_of(&[(60, b"PXEClient:Arch:00006:UNDI:003000"), (93, &[0, 6])]),
            None
        );
    }

    #[test]
    fn every_architecture_and_the_uuid_are_kept() {
        let mut uuid = vec![0u8];
        uuid.extend([
            0x33, 0x22, 0x11, 0x00, 0x55, 0x44, 0x77, 0x66, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd,
            0xee, 0xff,
        ]);
        let req = check(&request(
            MAC,
            &[
                (53, &[1]),
                (60, b"PXEClient"),
                (93, &[0, 7, 0, 9, 0, 16]),
                (97, &uuid),
            ],
        ))
        .unwrap();
        let c = classify(&req);
        assert_eq!(c.arches, [7, 9, 16]);
        assert_eq!(
            c.uuid.as_deref(),
            Some("00112233-4455-6677-8899-aabbccddeeff")
        );
        let zeros = [0u8; 17];
        let req = check(&request(MAC, &[(53, &[1]), (97, &zeros)])).unwrap();
        assert_eq!(classify(&req).uuid, None, "QEMU without -uuid sends zeros");
    }
}
