//! Attestation judgement, pure: does what the node reports running match what its boot
//! was given? Every mismatch is named; the agent reports raw facts, the server judges.

use std::collections::{BTreeMap, BTreeSet};

use crate::api::Digest;
use crate::api::agent::{AttestReport, Mismatch, Verdict};

/// What the boot was given.
#[derive(Debug, Clone)]
pub struct Expected<'a> {
    pub image_digest: Digest,
    pub boot_id: &'a str,
    /// The image's command line (the node's must contain every word of it).
    pub cmdline: &'a str,
    /// The manifest's pins; `kernel` is compared with the kernel release.
    pub pins: &'a BTreeMap<String, String>,
    pub artifacts: &'a [Digest],
    /// The artifacts the boot script delivers (path, digest, size): each must have
    /// reached this boot from us.
    pub delivered_by_script: &'a [(String, Digest, u64)],
    /// The image's other artifacts (rootfs), with their sizes: (path, digest, size).
    pub other_sizes: &'a [(String, Digest, u64)],
    /// What this boot's downloads carried, per digest.
    pub received: &'a BTreeMap<Digest, Received>,
    /// The root hash the image's rootfs is verified against (`[rootfs.verity]`): the
    /// node's root must be read through dm-verity with exactly it.
    pub verity_root_hash: Option<&'a str>,
}

/// What one boot's downloads of one blob carried.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Received {
    /// Distinct bytes of the blob sent, over all responses (a resumed download is
    /// several ranges; the same range twice counts once).
    pub bytes: u64,
    /// One response sent the whole blob, to its last byte.
    pub whole: bool,
}

impl Received {
    /// A boot's downloads per blob, counting each byte of the blob once.
    pub fn tally<'a>(
        fetches: impl IntoIterator<Item = &'a crate::store::Fetch>,
    ) -> BTreeMap<Digest, Received> {
        let mut ranges: BTreeMap<Digest, Vec<(u64, u64)>> = BTreeMap::new();
        let mut out: BTreeMap<Digest, Received> = BTreeMap::new();
        for f in fetches {
            let r = out.entry(f.digest).or_default();
            r.whole |= f.whole && f.finished_at_ms.is_some();
            ranges
                .entry(f.digest)
                .or_default()
                .push((f.offset, f.offset.saturating_add(f.bytes)));
        }
        for (digest, spans) in ranges {
            out.entry(digest).or_default().bytes = covered(spans);
        }
        out
    }

    /// Whether a blob of `size` bytes reached the boot: one whole response, or ranges
    /// covering it.
    pub fn complete(&self, size: u64) -> bool {
        self.whole || self.bytes >= size
    }
}

/// The length of the union of half-open byte ranges.
fn covered(mut spans: Vec<(u64, u64)>) -> u64 {
    spans.sort_unstable();
    let mut total = 0;
    let mut reach = 0;
    for (start, end) in spans {
        let start = start.max(reach);
        if end > start {
            total += end - start;
            reach = end;
        }
    }
    total
}

pub fn judge(report: &AttestReport, expected: &Expected<'_>) -> Verdict {
    let mut mismatches = Vec::new();
    let mut check = |field: &str, expected: String, found: String| {
        if expected != found {
            mismatches.push(Mismatch {
                field: field.into(),
                expected,
                found,
            });
        }
    };
    check(
        "image",
        expected.image_digest.to_string(),
        report.image_digest.to_string(),
    );
    if let Some(why) = &report.stage1_failure {
        check(
            "stage1",
            "the root fetched, verified and mounted".into(),
            why.clone(),
        );
    }
    if let Some(root) = expected.verity_root_hash {
        check(
            "rootfs.verity",
            root.to_string(),
            report
                .verity_root_hash
                .clone()
                .unwrap_or_else(|| "(the root is not on dm-verity)".into()),
        );
    }
    let words: BTreeSet<&str> = report.cmdline.split_whitespace().collect();
    for word in expected.cmdline.split_whitespace() {
        if !words.contains(word) {
            check("cmdline", word.to_string(), "(absent)".into());
        }
    }
    let boot_word = format!("bootfleet.boot={}", expected.boot_id);
    if !words.contains(boot_word.as_str()) {
        check("cmdline", boot_word, "(absent)".into());
    }
    for (name, version) in expected.pins {
        let found = if name == "kernel" {
            Some(report.kernel_release.clone())
        } else {
            report.versions.get(name).cloned()
        };
        check(
            &format!("pins.{name}"),
            version.clone(),
            found.unwrap_or_else(|| "(not reported)".into()),
        );
    }
    let want: BTreeSet<&Digest> = expected.artifacts.iter().collect();
    let got: BTreeSet<&Digest> = report.artifacts.iter().collect();
    // An artifact is accounted for if the node verified it, or if this boot downloaded
    // it whole from us: firmware gives the agent no way to re-hash the kernel it booted.
    let arrived_whole = |d: &Digest| {
        let sizes = expected
            .delivered_by_script
            .iter()
            .chain(expected.other_sizes.iter());
        let size = sizes
            .filter(|(_, dd, _)| dd == d)
            .map(|(_, _, s)| *s)
            .next();
        let got = expected.received.get(d).copied().unwrap_or_default();
        got.whole || size.is_some_and(|s| got.complete(s))
    };
    // A root read through dm-verity with the manifest's root hash is the manifest's root,
    // block by block, wherever its bytes came from (a node's local cache).
    let verity_proved = expected.verity_root_hash.is_some()
        && expected.verity_root_hash == report.verity_root_hash.as_deref();
    let proved =
        |d: &Digest| verity_proved && expected.other_sizes.iter().any(|(_, dd, _)| dd == d);
    for d in want.difference(&got) {
        if !arrived_whole(d) && !proved(d) {
            check(
                "artifacts",
                d.to_string(),
                "(neither verified by the node nor fetched whole by this boot)".into(),
            );
        }
    }
    for d in got.difference(&want) {
        check("artifacts", "(not in the image)".into(), d.to_string());
    }
    for (path, digest, size) in expected.delivered_by_script {
        let got = expected.received.get(digest).copied().unwrap_or_default();
        if !got.complete(*size) {
            let found = if got.bytes == 0 {
                "never fetched by this boot".to_string()
            } else {
                format!("{} of {size} bytes fetched by this boot", got.bytes)
            };
            check(
                &format!("fetched.{path}"),
                format!("{digest} received by this boot"),
                found,
            );
        }
    }
    Verdict {
        passed: mismatches.is_empty(),
        mismatches,
        tpm: None,
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_same_range_twice_is_not_the_whole() {
        let part = |offset, bytes| crate::store::Fetch {
            digest: Digest::of(b"kernel"),
            started_at_ms: 0,
            finished_at_ms: Some(1),
            offset,
            bytes,
            whole: false,
        };
        let tally =
            |fetches: &[crate::store::Fetch]| Received::tally(fetches)[&Digest::of(b"kernel")];
        // The first half of 1000 bytes, twice: 500 distinct bytes.
        assert!(!tally(&[part(0, 500), part(0, 500)]).complete(1000));
        // Overlapping ranges that do cover it, in any order.
        assert!(tally(&[part(400, 600), part(0, 500)]).complete(1000));
        assert_eq!(
            tally(&[part(0, 500), part(600, 100), part(550, 100)]).bytes,
            650
        );
    }
    use super::*;

    fn pins() -> BTreeMap<String, String> {
        BTreeMap::from([
            ("kernel".to_string(), "6.1.0-28-cloud-amd64".to_string()),
            ("nvidia-driver".to_string(), "550.127.05".to_string()),
        ])
    }

    fn report() -> AttestReport {
        AttestReport {
            image_digest: Digest::of(b"image"),
            kernel_release: "6.1.0-28-cloud-amd64".into(),
            cmdline: "initrd=initrd.img console=ttyS0 quiet bootfleet.boot=b1 bootfleet.token=x"
                .into(),
            versions: BTreeMap::from([("nvidia-driver".to_string(), "550.127.05".to_string())]),
            artifacts: vec![Digest::of(b"k"), Digest::of(b"i")],
            modules: BTreeMap::new(),
            verity_root_hash: None,
            stage1_failure: None,
        }
    }

    fn verdict(r: &AttestReport) -> Verdict {
        verdict_with(r, &received())
    }

    fn received() -> BTreeMap<Digest, Received> {
        BTreeMap::from([
            (
                Digest::of(b"k"),
                Received {
                    bytes: 100,
                    whole: true,
                },
            ),
            (
                Digest::of(b"i"),
                Received {
                    bytes: 50,
                    whole: false,
                },
            ),
        ])
    }

    fn verdict_with(r: &AttestReport, received: &BTreeMap<Digest, Received>) -> Verdict {
        let pins = pins();
        let artifacts = [Digest::of(b"k"), Digest::of(b"i")];
        let by_script = [
            ("vmlinuz".to_string(), Digest::of(b"k"), 100),
            ("initrd.img".to_string(), Digest::of(b"i"), 50),
        ];
        judge(
            r,
            &Expected {
                image_digest: Digest::of(b"image"),
                boot_id: "b1",
                cmdline: "console=ttyS0 quiet",
                pins: &pins,
                artifacts: &artifacts,
                delivered_by_script: &by_script,
                other_sizes: &[],
                received,
                verity_root_hash: None,
            },
        )
    }

    #[test]
    fn an_artifact_this_boot_did_not_receive_is_named() {
        let mut got = received();
        got.remove(&Digest::of(b"k"));
        got.insert(
            Digest::of(b"i"),
            Received {
                bytes: 20,
                whole: false,
            },
        );
        let v = verdict_with(&report(), &got);
        let found: Vec<(&str, &str)> = v
            .mismatches
            .iter()
            .map(|m| (m.field.as_str(), m.found.as_str()))
            .collect();
        assert_eq!(
            found,
            [
                ("fetched.vmlinuz", "never fetched by this boot"),
                ("fetched.initrd.img", "20 of 50 bytes fetched by this boot")
            ]
        );
    }

    fn check_passes(change: fn(&mut AttestReport)) {
        let mut r = report();
        change(&mut r);
        let v = verdict(&r);
        assert!(v.passed, "{v:?}");
    }

    fn fields(v: &Verdict) -> Vec<&str> {
        v.mismatches.iter().map(|m| m.field.as_str()).collect()
    }

    #[test]
    fn a_faithful_report_passes() {
        let v = verdict(&report());
        assert!(v.passed, "{v:?}");
    }

    #[test]
    fn every_difference_is_named() {
        let check = |change: fn(&mut AttestReport), expected: &[&str]| {
            let mut r = report();
            change(&mut r);
            let v = verdict(&r);
            assert!(!v.passed);
            assert_eq!(fields(&v), expected, "{v:?}");
        };
        check(|r| r.image_digest = Digest::of(b"other"), &["image"]);
        check(
            |r| r.kernel_release = "6.1.0-27-cloud-amd64".into(),
            &["pins.kernel"],
        );
        check(
            |r| r.cmdline = r.cmdline.replace(" quiet", ""),
            &["cmdline"],
        );
        check(
            |r| r.cmdline = r.cmdline.replace("bootfleet.boot=b1", "bootfleet.boot=b0"),
            &["cmdline"],
        );
        check(|r| r.versions.clear(), &["pins.nvidia-driver"]);
        check(
            |r| {
                r.versions.insert("nvidia-driver".into(), "535.1".into());
            },
            &["pins.nvidia-driver"],
        );
        // Not reported but fetched whole by this boot: accounted for.
        check_passes(|r| {
            r.artifacts.pop();
        });
        check(|r| r.artifacts.push(Digest::of(b"extra")), &["artifacts"]);
        check(
            |r| r.stage1_failure = Some("rootfs hashes to sha256:00".into()),
            &["stage1"],
        );
    }

    #[test]
    fn a_verified_root_must_run_on_its_root_hash() {
        let judge_with = |found: Option<&str>| {
            let mut r = report();
            r.verity_root_hash = found.map(String::from);
            let pins = pins();
            let artifacts = [Digest::of(b"k"), Digest::of(b"i")];
            let got = received();
            judge(
                &r,
                &Expected {
                    image_digest: Digest::of(b"image"),
                    boot_id: "b1",
                    cmdline: "console=ttyS0 quiet",
                    pins: &pins,
                    artifacts: &artifacts,
                    delivered_by_script: &[],
                    other_sizes: &[],
                    received: &got,
                    verity_root_hash: Some("ab12"),
                },
            )
        };
        assert!(judge_with(Some("ab12")).passed);
        for found in [Some("cd34"), None] {
            let v = judge_with(found);
            assert_eq!(fields(&v), ["rootfs.verity"], "{v:?}");
        }
    }
}
