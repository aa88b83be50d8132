//! Boot scripts: iPXE scripts rendered from minijinja templates held in memory (built in,
//! or an operator's directory read once at start). Pure: no request, no database.

use std::path::Path;

use minijinja::Environment;
use serde::Serialize;

use crate::api::Digest;

/// The templates, by name; `templates/` in the repository, compiled into the binary.
const BUILTIN: &[(&str, &str)] = &[
    (
        "entry.ipxe.j2",
        include_str!("../../templates/entry.ipxe.j2"),
    ),
    ("node.ipxe.j2", include_str!("../../templates/node.ipxe.j2")),
    (
        "unassigned.ipxe.j2",
        include_str!("../../templates/unassigned.ipxe.j2"),
    ),
    (
        "unknown.ipxe.j2",
        include_str!("../../templates/unknown.ipxe.j2"),
    ),
    ("held.ipxe.j2", include_str!("../../templates/held.ipxe.j2")),
    (
        "entry.grub.j2",
        include_str!("../../templates/entry.grub.j2"),
    ),
    ("node.grub.j2", include_str!("../../templates/node.grub.j2")),
    (
        "unassigned.grub.j2",
        include_str!("../../templates/unassigned.grub.j2"),
    ),
    (
        "unknown.grub.j2",
        include_str!("../../templates/unknown.grub.j2"),
    ),
    ("held.grub.j2", include_str!("../../templates/held.grub.j2")),
];

/// The boot program a script is written for: iPXE, or GRUB (the Secure Boot chain:
/// shim, then Debian's signed GRUB, which loads only signed kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loader {
    Ipxe,
    /// Debian's signed GRUB has no HTTP: its files come over TFTP from `tftp`.
    Grub {
        tftp: std::net::IpAddr,
    },
}

impl Loader {
    fn template(self, stem: &str) -> String {
        match self {
            Loader::Ipxe => format!("{stem}.ipxe.j2"),
            Loader::Grub { .. } => format!("{stem}.grub.j2"),
        }
    }
}

/// The templates of one boot program.
pub struct Scripts<'a> {
    templates: &'a BootTemplates,
    loader: Loader,
}

/// Retry delays (seconds) for every fetch of a boot: 1, 2, 4, 8, 16 (31 s in all).
pub const RETRY_DELAYS: [u32; 5] = [1, 2, 4, 8, 16];

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("template {name}: {message}")]
    Invalid { name: String, message: String },
    #[error("cannot read template {path}: {source}")]
    Read {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

pub struct BootTemplates {
    env: Environment<'static>,
    /// `[cluster] servers`: every server's HTTP base as nodes reach it, for a node to
    /// fall back to when the one it talks to does not answer.
    peers: Vec<String>,
}

/// One initrd of the script: the name iPXE gives it (UEFI kernels find it by that name
/// through `initrd=<name>`) and its digest URL.
#[derive(Debug, Clone, Serialize)]
pub struct InitrdRef {
    pub name: String,
    pub url: String,
}

/// What a node's script needs of its image.
#[derive(Debug, Clone, Serialize)]
pub struct ImageBoot {
    pub name: String,
    pub version: String,
    pub digest: Digest,
    pub kernel_url: String,
    pub initrds: Vec<InitrdRef>,
    pub cmdline: String,
    /// `[validation] dcgm-level`: the agent runs DCGM diagnostics at this level.
    pub dcgm_level: Option<u64>,
    /// A two-stage image's root: stage 1 fetches it by digest and mounts it through
    /// dm-verity; the script loads only the kernel and stage 1.
    pub rootfs: Option<RootfsBoot>,
}

/// What stage 1 needs of the root, on the kernel command line.
#[derive(Debug, Clone, Serialize)]
pub struct RootfsBoot {
    pub digest: Digest,
    pub size: u64,
    pub verity: crate::api::image::Verity,
}

/// A node's boot: who, what, and the per-boot credentials that go on the command line.
#[derive(Debug, Clone)]
pub struct NodeBoot<'a> {
    pub server: &'a str,
    pub mac: &'a str,
    pub boot_id: &'a str,
    pub token: &'a str,
    pub image: &'a ImageBoot,
    /// A two-stage node's local root cache: the label of its file system.
    pub rootfs_cache: Option<&'a str>,
}

/// The URL of a blob as nodes fetch it.
/// An artifact's URL for one boot: `?boot=` attributes the download to the boot, so the
/// server knows what the node actually received.
pub fn blob_url(server: &str, digest: &Digest, boot_id: &str) -> String {
    format!(
        "{}/blobs/sha256/{}?boot={boot_id}",
        server.trim_end_matches('/'),
        digest.hex()
    )
}

/// A template environment where an undefined variable is an error (a typo must not boot
/// a node with an empty URL or write an empty file) and a file's last newline is kept.
pub(super) fn strict_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .keep_trailing_newline(true)
            .build()
            .expect("default delimiters are valid"),
    );
    env.add_filter("grub_tftp", grub_tftp);
    env.add_filter("grub_quote", grub_quote);
    env
}

/// A URL of ours as GRUB fetches the same file over TFTP from `host`: `(tftp,HOST)/path?query`.
/// (The TFTP server serves blobs at the same paths; GRUB appends the query to the name.)
fn grub_tftp(url: &str, host: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let path = rest.find('/').map_or("", |i| &rest[i + 1..]);
    format!("(tftp,{host})/{path}")
}

/// One word in single quotes, where GRUB expands nothing (`'` itself as `'\''`).
fn grub_quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', "'\\''"))
}

impl BootTemplates {
    /// The templates compiled into the binary.
    pub fn builtin() -> Self {
        Self::from_sources(BUILTIN.iter().map(|(n, s)| (n.to_string(), s.to_string())))
            .expect("built-in templates are valid (a test renders each)")
    }

    /// The built-in templates, each replaced by a file of the same name in `dir` if there
    /// is one. Read once: requests never touch the disk.
    pub fn with_overrides(dir: &Path) -> Result<Self, TemplateError> {
        let mut sources = Vec::new();
        for (name, builtin) in BUILTIN {
            let path = dir.join(name);
            let text = match std::fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => builtin.to_string(),
                Err(source) => return Err(TemplateError::Read { path, source }),
            };
            sources.push((name.to_string(), text));
        }
        Self::from_sources(sources.into_iter())
    }

    fn from_sources(
        sources: impl Iterator<Item = (String, String)>,
    ) -> Result<Self, TemplateError> {
        let mut env = strict_environment();
        for (name, text) in sources {
            env.add_template_owned(name.clone(), text)
                .map_err(|e| TemplateError::Invalid {
                    name,
                    message: e.to_string(),
                })?;
        }
        Ok(Self {
            env,
            peers: Vec::new(),
        })
    }

    /// The servers a node falls back to (`[cluster] servers`).
    pub fn with_peers(mut self, peers: Vec<String>) -> Self {
        self.peers = peers;
        self
    }

    /// `server` first, then the other peers, each once.
    fn servers(&self, server: &str) -> Vec<String> {
        let mut all = vec![server.trim_end_matches('/').to_string()];
        for p in &self.peers {
            let p = p.trim_end_matches('/');
            if !all.iter().any(|s| s == p) {
                all.push(p.to_string());
            }
        }
        all
    }

    fn render(&self, name: &str, ctx: minijinja::Value) -> Result<String, TemplateError> {
        let invalid = |e: minijinja::Error| TemplateError::Invalid {
            name: name.to_string(),
            message: format!("{e:#}"),
        };
        self.env
            .get_template(name)
            .map_err(invalid)?
            .render(ctx)
            .map_err(invalid)
    }

    /// The scripts of one boot program.
    pub fn scripts(&self, loader: Loader) -> Scripts<'_> {
        Scripts {
            templates: self,
            loader,
        }
    }

    pub fn ipxe(&self) -> Scripts<'_> {
        self.scripts(Loader::Ipxe)
    }

    /// GRUB's, for files served over TFTP from `tftp`.
    pub fn grub(&self, tftp: std::net::IpAddr) -> Scripts<'_> {
        self.scripts(Loader::Grub { tftp })
    }
}

impl Scripts<'_> {
    fn render(&self, stem: &str, ctx: minijinja::Value) -> Result<String, TemplateError> {
        let tftp = match self.loader {
            Loader::Grub { tftp } => tftp.to_string(),
            Loader::Ipxe => String::new(),
        };
        let ctx = minijinja::context! { tftp, ..ctx };
        self.templates.render(&self.loader.template(stem), ctx)
    }

    /// `/boot.ipxe`: the same for every client.
    pub fn entry(&self, server: &str) -> Result<String, TemplateError> {
        let servers = self.templates.servers(server);
        self.render("entry", minijinja::context! { server, servers })
    }

    /// A node with an image: kernel and initrds by digest, with retries.
    pub fn node(&self, b: &NodeBoot<'_>) -> Result<String, TemplateError> {
        // iPXE hands a UEFI kernel its initrds by name; GRUB's initrd command loads them.
        let initrd_args: Vec<String> = match self.loader {
            Loader::Ipxe => b
                .image
                .initrds
                .iter()
                .map(|i| format!("initrd={}", i.name))
                .collect(),
            Loader::Grub { .. } => Vec::new(),
        };
        // The image's command line, then what the agent needs to find and prove its boot.
        let kernel_args = [
            initrd_args.join(" "),
            b.image.cmdline.clone(),
            format!("bootfleet.server={}", b.server),
            // The others, for the agent to turn to when its server does not answer.
            match self.templates.servers(b.server).as_slice() {
                [_only] => String::new(),
                servers => format!("bootfleet.servers={}", servers.join(",")),
            },
            format!("bootfleet.boot={}", b.boot_id),
            format!("bootfleet.token={}", b.token),
            format!("bootfleet.image={}", b.image.digest),
            format!("bootfleet.mac={}", b.mac),
            b.image
                .dcgm_level
                .map(|l| format!("bootfleet.dcgm={l}"))
                .unwrap_or_default(),
            b.image
                .rootfs
                .as_ref()
                .map(|r| {
                    let cache = b
                        .rootfs_cache
                        .map(|l| format!(" bootfleet.rootfs_cache={l}"))
                        .unwrap_or_default();
                    // Stage 1 runs as PID 1: if it ever exits, reboot instead of hanging.
                    let panic = if b.image.cmdline.split_whitespace().any(|w| w.starts_with("panic=")) {
                        ""
                    } else {
                        " panic=30"
                    };
                    format!(
                        "bootfleet.rootfs={} bootfleet.rootfs_size={} bootfleet.verity={}{cache}{panic}",
                        r.digest,
                        r.size,
                        r.verity.kernel_arg()
                    )
                })
                .unwrap_or_default(),
        ]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
        let kernel_words: Vec<String> = kernel_args.split_whitespace().map(String::from).collect();
        self.render(
            "node",
            minijinja::context! {
                server => b.server,
                mac => b.mac,
                boot_id => b.boot_id,
                image => minijinja::Value::from(minijinja::value::Serde(b.image)),
                kernel_args,
                kernel_words,
                delays => RETRY_DELAYS,
            },
        )
    }

    /// A known node we boot nothing on: labelled `boot=local` (`local_boot`: exit to the
    /// firmware's next boot device), or with nothing assigned (wait and ask again).
    pub fn unassigned(
        &self,
        server: &str,
        mac: &str,
        local_boot: bool,
    ) -> Result<String, TemplateError> {
        self.render(
            "unassigned",
            minijinja::context! { server, mac, local_boot, retry_seconds => 60 },
        )
    }

    /// A node whose state forbids booting now (quarantined, or its image is missing).
    pub fn held(
        &self,
        server: &str,
        mac: &str,
        state: &str,
        reason: &str,
    ) -> Result<String, TemplateError> {
        self.render(
            "held",
            minijinja::context! { server, mac, state, reason, retry_seconds => 60 },
        )
    }

    /// A node seen for the first time.
    pub fn unknown(&self, server: &str, mac: &str) -> Result<String, TemplateError> {
        self.render(
            "unknown",
            minijinja::context! { server, mac, retry_seconds => 60 },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image() -> ImageBoot {
        let server = "http://10.0.0.1:8080";
        ImageBoot {
            name: "gpu-node".into(),
            version: "2026.12.0".into(),
            digest: Digest::of(b"image"),
            kernel_url: blob_url(server, &Digest::of(b"kernel"), "b1"),
            initrds: vec![
                InitrdRef {
                    name: "initrd.img".into(),
                    url: blob_url(server, &Digest::of(b"initrd"), "b1"),
                },
                InitrdRef {
                    name: "modules.cpio".into(),
                    url: blob_url(server, &Digest::of(b"modules"), "b1"),
                },
            ],
            cmdline: "console=ttyS0 quiet".into(),
            dcgm_level: None,
            rootfs: None,
        }
    }

    #[test]
    fn a_two_stage_image_names_its_root_for_stage_one() {
        let mut image = image();
        let verity = crate::api::image::Verity {
            root_hash: "ab".repeat(32),
            hash_offset: 8192,
            data_blocks: 2,
            algorithm: "sha256".into(),
            salt: "-".into(),
        };
        image.rootfs = Some(RootfsBoot {
            digest: Digest::of(b"root"),
            size: 8704,
            verity: verity.clone(),
        });
        let s = BootTemplates::builtin()
            .ipxe()
            .node(&NodeBoot {
                server: "http://10.0.0.1:8080",
                mac: "52-54-00-12-34-56",
                boot_id: "b-42",
                token: "secret-token",
                image: &image,
                rootfs_cache: Some("bootfleet-cache"),
            })
            .unwrap();
        let words = format!(
            "bootfleet.rootfs={} bootfleet.rootfs_size=8704 bootfleet.verity={} bootfleet.rootfs_cache=bootfleet-cache panic=30",
            Digest::of(b"root"),
            verity.kernel_arg()
        );
        assert!(s.contains(&words), "{s}");
    }

    fn node_script(t: &BootTemplates) -> String {
        let image = image();
        t.ipxe()
            .node(&NodeBoot {
                server: "http://10.0.0.1:8080",
                mac: "52-54-00-12-34-56",
                boot_id: "b-42",
                token: "secret-token",
                image: &image,
                rootfs_cache: None,
            })
            .unwrap()
    }

    #[test]
    fn every_file_in_templates_is_built_in() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("templates");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        let mut built_in: Vec<String> = BUILTIN.iter().map(|(n, _)| n.to_string()).collect();
        on_disk.sort();
        built_in.sort();
        assert_eq!(on_disk, built_in);
    }

    #[test]
    fn a_node_is_given_the_other_servers_to_fall_back_to() {
        let t = BootTemplates::builtin().with_peers(vec![
            "http://10.0.0.1:8080/".into(),
            "http://10.0.0.2:8080".into(),
        ]);
        let entry = t.ipxe().entry("http://10.0.0.1:8080").unwrap();
        let chains: Vec<&str> = entry.lines().filter(|l| l.starts_with("chain ")).collect();
        assert_eq!(chains.len(), 2, "its own server, then the other: {entry}");
        assert!(chains[0].contains("http://10.0.0.1:8080/boot/node.ipxe"));
        assert!(chains[1].contains("http://10.0.0.2:8080/boot/node.ipxe"));
        let b = NodeBoot {
            server: "http://10.0.0.2:8080",
            mac: "52-54-00-12-34-56",
            boot_id: "b-1",
            token: "t",
            image: &image(),
            rootfs_cache: None,
        };
        let script = t.ipxe().node(&b).unwrap();
        assert!(
            script.contains("bootfleet.servers=http://10.0.0.2:8080,http://10.0.0.1:8080 "),
            "{script}"
        );
        let alone = BootTemplates::builtin().ipxe().node(&b).unwrap();
        assert!(!alone.contains("bootfleet.servers="), "{alone}");
    }

    #[test]
    fn every_builtin_template_renders() {
        let t = BootTemplates::builtin();
        let entry = t.ipxe().entry("http://10.0.0.1:8080").unwrap();
        assert!(entry.starts_with("#!ipxe\n"), "{entry}");
        assert!(entry.contains(
            "chain --autofree http://10.0.0.1:8080/boot/node.ipxe?mac=${mac:hexhyp}&uuid=${uuid}"
        ));
        let unassigned = t.ipxe().unassigned("http://s", "aa-bb", true).unwrap();
        assert!(unassigned.contains("\nexit"), "{unassigned}");
        let waiting = t.ipxe().unassigned("http://s", "aa-bb", false).unwrap();
        assert!(
            waiting.contains("sleep 60") && waiting.contains("chain --autofree http://s/boot.ipxe")
        );
        let held = t
            .ipxe()
            .held("http://s", "aa-bb", "quarantined", "3 failed validations")
            .unwrap();
        assert!(
            held.contains("aa-bb is quarantined: 3 failed validations"),
            "{held}"
        );
        let unknown = t.ipxe().unknown("http://s", "aa-bb").unwrap();
        assert!(unknown.starts_with("#!ipxe\n") && unknown.contains("aa-bb"));
        assert!(node_script(&t).starts_with("#!ipxe\n"));
    }

    #[test]
    fn node_script_boots_by_digest_with_retries_and_the_boot_credentials() {
        let s = node_script(&BootTemplates::builtin());
        let kernel = format!(
            "kernel http://10.0.0.1:8080/blobs/sha256/{}",
            Digest::of(b"kernel").hex()
        );
        let kernel_line = s.lines().find(|l| l.starts_with(&kernel)).expect(&s);
        assert!(
            kernel_line.contains(" initrd=initrd.img initrd=modules.cpio console=ttyS0 quiet bootfleet.server=http://10.0.0.1:8080 bootfleet.boot=b-42 bootfleet.token=secret-token "),
            "{kernel_line}"
        );
        // Each fetch tried once per delay, then the failure path.
        assert_eq!(s.matches(&kernel).count(), RETRY_DELAYS.len());
        assert_eq!(
            s.matches("initrd --name initrd.img ").count(),
            RETRY_DELAYS.len()
        );
        assert_eq!(
            s.matches("initrd --name modules.cpio ").count(),
            RETRY_DELAYS.len()
        );
        for d in RETRY_DELAYS {
            assert!(s.contains(&format!("sleep {d}\n")), "sleep {d}");
        }
        assert!(s.contains(":failed\necho bootfleet: boot of gpu-node:2026.12.0 failed"));
        // Kernel before initrds, then boot.
        let first_kernel = s.find("\nkernel ").unwrap();
        let first_initrd = s.find("\ninitrd ").unwrap();
        let boot = s.find("\nboot ||").unwrap();
        assert!(first_kernel < first_initrd && first_initrd < boot, "{s}");
        // Every goto has its label.
        for target in s
            .lines()
            .filter_map(|l| l.split("goto ").nth(1))
            .map(|t| t.trim_end_matches(" ||").trim())
        {
            assert!(
                s.contains(&format!("\n:{target}\n")),
                "missing label {target}"
            );
        }
    }

    #[test]
    fn operator_templates_override_and_bad_ones_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("entry.ipxe.j2"),
            "#!ipxe\n# site {{ server }}\n",
        )
        .unwrap();
        let t = BootTemplates::with_overrides(dir.path()).unwrap();
        assert_eq!(
            t.ipxe().entry("http://x").unwrap(),
            "#!ipxe\n# site http://x\n"
        );
        assert!(
            node_script(&t).contains("kernel http://"),
            "others stay built in"
        );

        std::fs::write(dir.path().join("node.ipxe.j2"), "#!ipxe\n{% for %}\n").unwrap();
        let e = BootTemplates::with_overrides(dir.path())
            .err()
            .expect("syntax error refused");
        assert!(e.to_string().contains("node.ipxe.j2"), "{e}");

        std::fs::write(
            dir.path().join("node.ipxe.j2"),
            "#!ipxe\nkernel {{ image.kernle_url }}\n",
        )
        .unwrap();
        let t = BootTemplates::with_overrides(dir.path()).unwrap();
        let image = image();
        let e = t
            .ipxe()
            .node(&NodeBoot {
                server: "s",
                mac: "m",
                boot_id: "b",
                token: "t",
                image: &image,
                rootfs_cache: None,
            })
            .unwrap_err();
        assert!(
            e.to_string().contains("kernle_url") || e.to_string().contains("undefined"),
            "{e}"
        );
    }

    #[test]
    fn a_grub_script_fetches_by_digest_over_tftp_with_every_word_quoted() {
        let t = BootTemplates::builtin();
        let mut image = image();
        image.cmdline = "console=ttyS0 it's $HOME".into();
        let tftp: std::net::IpAddr = "10.0.0.1".parse().unwrap();
        let s = t
            .grub(tftp)
            .node(&NodeBoot {
                server: "http://10.0.0.1:8080",
                mac: "52-54-00-12-34-56",
                boot_id: "b-42",
                token: "b-42.secret",
                image: &image,
                rootfs_cache: None,
            })
            .unwrap();
        let linux = s.lines().find(|l| l.starts_with("linux ")).expect(&s);
        let kernel = format!(
            "linux '(tftp,10.0.0.1)/blobs/sha256/{}?boot=b1'",
            Digest::of(b"kernel").hex()
        );
        assert!(linux.starts_with(&kernel), "{linux}");
        // Quoted word by word: GRUB expands nothing, and a quote survives.
        for word in [
            "'console=ttyS0'",
            r"'it'\''s'",
            "'$HOME'",
            "'bootfleet.token=b-42.secret'",
            "'bootfleet.server=http://10.0.0.1:8080'",
        ] {
            assert!(linux.contains(word), "{word} not in {linux}");
        }
        assert!(!linux.contains("initrd="), "{linux}");
        let initrd = s.lines().find(|l| l.starts_with("initrd ")).expect(&s);
        assert!(
            initrd.contains("'(tftp,10.0.0.1)/blobs/sha256/"),
            "{initrd}"
        );
        assert!(s.contains("\nboot\n"), "{s}");
        // The entry asks for the node's own file, over TFTP.
        let entry = t.grub(tftp).entry("http://10.0.0.1:8080").unwrap();
        assert!(
            entry.contains(
                "configfile \"(tftp,${net_default_server})/boot/node.grub?mac=${net_default_mac}\""
            ),
            "{entry}"
        );
        let unknown = t.grub(tftp).unknown("http://s", "aa-bb").unwrap();
        assert!(
            unknown.contains("configfile '(tftp,10.0.0.1)/boot/node.grub?mac=aa-bb'"),
            "{unknown}"
        );
    }
}
