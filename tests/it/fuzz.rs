//! Property tests on hostile input for TFTP packets, manifests and bundles: random bytes
//! and mutations of well-formed seeds go through the same `exercise` functions the
//! cargo-fuzz targets call (`fuzz/`). Nothing may panic, what we encode parses back, a
//! refusal says why, and a refused bundle leaves nothing behind.

use bootfleet::image::blobstore::BlobStore;
use bootfleet::image::exercise::{exercise_bundle, exercise_manifest, small_limits};
use bootfleet::tftp::exercise::exercise as exercise_tftp;

use crate::harness::*;

fn tftp_seeds() -> Vec<Vec<u8>> {
    let rrq = |name: &str, options: &[(&str, &str)]| {
        let mut p = vec![0, 1];
        for part in [name, "octet"]
            .into_iter()
            .chain(options.iter().flat_map(|(k, v)| [*k, *v]))
        {
            p.extend_from_slice(part.as_bytes());
            p.push(0);
        }
        p
    };
    vec![
        rrq("undionly.kpxe", &[]),
        rrq(
            "snponly.efi",
            &[("blksize", "1468"), ("tsize", "0"), ("windowsize", "16")],
        ),
        rrq(
            "arm64/snponly.efi",
            &[("timeout", "3"), ("BLKSIZE", "65464")],
        ),
        vec![0, 2, b'x', 0, b'o', b'c', b't', b'e', b't', 0],
        [vec![0, 3, 0, 1], vec![0xab; 512]].concat(),
        vec![0, 4, 0xff, 0xff],
        [vec![0, 5, 0, 1], b"file not found\0".to_vec()].concat(),
        [vec![0, 6], b"blksize\x001428\0".to_vec()].concat(),
    ]
}

#[test]
fn random_and_mutated_tftp_packets_never_panic_and_round_trip() {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let seeds = tftp_seeds();
    for s in &seeds {
        assert!(exercise_tftp(s), "seed parses: {s:?}");
    }
    let mut parsed = 0;
    for i in 0..30_000 {
        let bytes = if i % 3 == 0 {
            let len = rng.below(600);
            (0..len).map(|_| rng.next() as u8).collect()
        } else {
            let mut p = seeds[rng.below(seeds.len())].clone();
            mutate(&mut rng, &mut p, 2);
            p
        };
        if exercise_tftp(&bytes) {
            parsed += 1;
        }
    }
    assert!(parsed > 5_000, "only {parsed} mutated packets parsed");
}

fn manifest_seeds() -> Vec<String> {
    vec![
        manifest("demo", "1"),
        "name = \"cpu\"\nversion = \"2024.1\"\n[boot]\nkernel = \"boot/vmlinuz\"\ninitrds = [\"boot/initrd.img\"]\n".into(),
        format!(
            "{}dcgm-level = 2\nnvlinks = 18\nfatal-xids = [48, 79]\n",
            manifest("gpu", "3")
        ),
    ]
}

/// Mutations at the level of text: a line dropped or doubled, a value replaced, a
/// character changed.
fn mutate_text(rng: &mut Rng, text: &str) -> String {
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    const TOKENS: [&str; 10] = [
        "\"eight\"",
        "8",
        "-1",
        "true",
        "[1, 2]",
        "{ a = 1 }",
        "\"\u{202e}x\"",
        "1e400",
        "\"../../etc/passwd\"",
        "",
    ];
    for _ in 0..1 + rng.below(3) {
        if lines.is_empty() {
            break;
        }
        let at = rng.below(lines.len());
        match rng.below(4) {
            0 => {
                lines.remove(at);
            }
            1 => {
                let l = lines[at].clone();
                lines.insert(at, l);
            }
            2 => {
                if let Some((key, _)) = lines[at].split_once('=') {
                    lines[at] = format!("{key}= {}", TOKENS[rng.below(TOKENS.len())]);
                }
            }
            _ => {
                let mut chars: Vec<char> = lines[at].chars().collect();
                if !chars.is_empty() {
                    let c = rng.below(chars.len());
                    chars[c] = ['_', '-', '"', '[', ']', '=', '\n', 'x'][rng.below(8)];
                }
                lines[at] = chars.into_iter().collect();
            }
        }
    }
    lines.join("\n")
}

#[test]
fn mutated_manifests_are_parsed_or_refused_with_a_reason() {
    let mut rng = Rng(0x5851_f42d_4c95_7f2d);
    let seeds = manifest_seeds();
    for s in &seeds {
        assert!(exercise_manifest(s), "seed is accepted:\n{s}");
    }
    let (mut accepted, mut refused) = (0, 0);
    for _ in 0..5_000 {
        let seed = &seeds[rng.below(seeds.len())];
        let text = mutate_text(&mut rng, seed);
        if exercise_manifest(&text) {
            accepted += 1;
        } else {
            refused += 1;
        }
    }
    assert!(
        accepted > 100 && refused > 100,
        "{accepted} accepted, {refused} refused"
    );
}

#[test]
fn random_and_mutated_bundles_are_staged_whole_or_refused_leaving_nothing() {
    let mut rng = Rng(0x94d0_49bb_1331_11eb);
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::open(dir.path()).unwrap();
    let limits = small_limits();
    let good = good_bundle("demo", "1", &noise(3000, 1));
    let seeds = [
        good.clone(),
        gzip(&good),
        zstd(&good),
        tar_of(&[
            file("manifest.toml", manifest("x", "1").as_bytes()),
            file("vmlinuz", b"k"),
            special("initrd.img", tar::EntryType::Symlink, Some("/etc/shadow")),
        ]),
    ];
    for s in &seeds[..3] {
        assert!(exercise_bundle(s, &store, &limits), "seed is staged");
    }
    let (mut staged, mut refused) = (0, 0);
    for i in 0..1_500 {
        let bytes = if i % 10 == 0 {
            let len = rng.below(4096);
            (0..len).map(|_| rng.next() as u8).collect()
        } else {
            let mut p = seeds[rng.below(seeds.len())].clone();
            // Byte changes land in the headers too: every 512-byte block may be one.
            mutate(&mut rng, &mut p, 0);
            p
        };
        if exercise_bundle(&bytes, &store, &limits) {
            staged += 1;
        } else {
            refused += 1;
        }
    }
    assert!(
        staged > 50 && refused > 50,
        "{staged} staged, {refused} refused"
    );
}
