//! The boot's parameters on the kernel command line, as the boot script put them there:
//! `bootfleet.server=` (and the others, `bootfleet.servers=`), `bootfleet.boot=`, `bootfleet.token=`, `bootfleet.image=`, and for
//! a two-stage boot the root's `bootfleet.rootfs=`, `bootfleet.rootfs_size=` and
//! `bootfleet.verity=`.

use bootfleet_api::Digest;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BootParams {
    pub server: Option<String>,
    /// Every server of the cluster (`bootfleet.servers=a,b,c`), for the agent to turn to
    /// when its own does not answer.
    pub servers: Vec<String>,
    pub boot: Option<String>,
    pub token: Option<String>,
    pub image: Option<Digest>,
    /// The MAC the node booted from (the node's identity at the server).
    pub mac: Option<bootfleet_api::Mac>,
    /// DCGM diagnostics level the image asks for.
    pub dcgm: Option<u64>,
    /// Two-stage boot: the rootfs blob stage 1 fetches, its size and its verity tree.
    pub rootfs: Option<Digest>,
    pub rootfs_size: Option<u64>,
    pub verity: Option<bootfleet_api::image::Verity>,
    /// The label of the node's file system that caches its root (`rootfs-cache=`).
    pub rootfs_cache: Option<String>,
}

pub fn parse(cmdline: &str) -> BootParams {
    let mut p = BootParams::default();
    for word in cmdline.split_whitespace() {
        let Some((key, value)) = word.split_once('=') else {
            continue;
        };
        match key {
            "bootfleet.server" => p.server = Some(value.to_string()),
            "bootfleet.servers" => {
                p.servers = value
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect()
            }
            "bootfleet.boot" => p.boot = Some(value.to_string()),
            "bootfleet.token" => p.token = Some(value.to_string()),
            "bootfleet.image" => p.image = value.parse().ok(),
            "bootfleet.mac" => p.mac = value.parse().ok(),
            "bootfleet.dcgm" => p.dcgm = value.parse().ok(),
            "bootfleet.rootfs" => p.rootfs = value.parse().ok(),
            "bootfleet.rootfs_size" => p.rootfs_size = value.parse().ok(),
            "bootfleet.rootfs_cache" => p.rootfs_cache = Some(value.to_string()),
            "bootfleet.verity" => p.verity = bootfleet_api::image::Verity::parse_kernel_arg(value),
            _ => {}
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_words_are_found_among_the_others() {
        let d = Digest::of(b"image");
        let p = parse(&format!(
            "initrd=initrd.img console=ttyS0 bootfleet.server=http://10.0.0.1:8080 bootfleet.boot=0123456789abcdef bootfleet.token=t0k bootfleet.image={d} bootfleet.mac=52-54-00-12-34-56 quiet\n"
        ));
        assert_eq!(p.server.as_deref(), Some("http://10.0.0.1:8080"));
        assert!(p.servers.is_empty());
        let cluster = parse("bootfleet.servers=http://a:1,http://b:2 x");
        assert_eq!(cluster.servers, vec!["http://a:1", "http://b:2"]);
        assert_eq!(p.boot.as_deref(), Some("0123456789abcdef"));
        assert_eq!(p.token.as_deref(), Some("t0k"));
        assert_eq!(p.image, Some(d));
        assert_eq!(
            p.mac.map(|m| m.to_string()).as_deref(),
            Some("52:54:00:12:34:56")
        );
        assert_eq!(parse("quiet"), BootParams::default());
        let root = Digest::of(b"root");
        let verity = format!("sha256:{}:2:8192:-", "ab".repeat(32));
        let p = parse(&format!(
            "bootfleet.rootfs={root} bootfleet.rootfs_size=16384 bootfleet.verity={verity}"
        ));
        assert_eq!(p.rootfs, Some(root));
        assert_eq!(p.rootfs_size, Some(16384));
        assert_eq!(p.verity.map(|v| v.kernel_arg()), Some(verity));
    }
}
