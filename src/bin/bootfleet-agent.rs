//! `bootfleet-agent`: runs on a booted node (see the `bootfleet-agent` crate).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use bootfleet_agent::boot_params;
use bootfleet_agent::gpu::{GpuSource, Nvml, Recorded};
use bootfleet_agent::run::{Agent, Outcome};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "bootfleet-agent",
    version,
    about = "Reports what a bootfleet node runs: attestation, GPU validation, heartbeats",
    long_about = "Reports what a bootfleet node runs. It reads bootfleet.server=, bootfleet.boot=, \
        bootfleet.token=, bootfleet.image= and bootfleet.mac= from the kernel command line (the \
        flags override them), posts attestation, then validation (GPUs through NVML, XIDs from \
        the kernel log), then heartbeats, and reboots when the server asks. Transient errors are \
        retried with back-off, forever; with bootfleet.servers= (the cluster's servers), a call \
        the server fails or does not answer goes to the next."
)]
struct Args {
    /// The server's URL [default: bootfleet.server= on the kernel command line].
    #[arg(long)]
    server: Option<String>,
    /// This boot's id [default: bootfleet.boot=].
    #[arg(long)]
    boot: Option<String>,
    /// This boot's token [default: bootfleet.token=].
    #[arg(long, env = "BOOTFLEET_BOOT_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The image digest this boot was given, sha256:<hex> [default: bootfleet.image=].
    #[arg(long)]
    image: Option<String>,
    /// This node's MAC [default: bootfleet.mac=].
    #[arg(long)]
    mac: Option<String>,
    /// PEM file of the CA that signed the server's certificate, for an https:// server
    /// (an initramfs has no system roots, so no other is trusted).
    #[arg(long, env = "BOOTFLEET_CA_FILE")]
    ca_file: Option<PathBuf>,
    /// Root of the /proc, /sys, /etc and /dev/kmsg to read.
    #[arg(long, default_value = "/")]
    root: PathBuf,
    /// Replay GPU readings from this JSON file instead of asking NVML.
    #[arg(long)]
    gpu_readings: Option<PathBuf>,
    /// Seconds between heartbeats.
    #[arg(long, default_value_t = 30)]
    heartbeat_secs: u64,
    /// Stop after the first heartbeat's answer.
    #[arg(long)]
    once: bool,
    /// On "reboot", exit with status 3 instead of rebooting.
    #[arg(long)]
    no_reboot: bool,
    /// Run `dcgmi diag -r LEVEL -j` during validation [default: bootfleet.dcgm= if set].
    #[arg(long)]
    dcgm_level: Option<u64>,
    /// A compute-probe command run with `sh -c` during validation; it passes on exit 0.
    #[arg(long)]
    probe: Option<String>,
    /// Seconds the compute probe (and each performance probe) may take.
    #[arg(long, default_value_t = 300)]
    probe_timeout_secs: u64,
    /// A performance probe run during validation, NAME=COMMAND (repeatable): its figure
    /// is the last number COMMAND prints (`--figure gemm_tflops='gemm-bench --json | jq
    /// .tflops'`); the server compares it with the node's peers' to find slow nodes.
    #[arg(long = "figure", value_name = "NAME=COMMAND", value_parser = figure_arg)]
    figures: Vec<(String, String)>,
    /// At validation, ask the fabric what each InfiniBand port's cable reaches (a
    /// directed-route SMP per port: `smpquery`, from infiniband-diags; needs root), so the
    /// server can check the cabling against the topology it was given.
    #[arg(long)]
    ib_peers: bool,
    /// Attest with the TPM reached through this TCTI (tpm2-tools' syntax:
    /// `swtpm:path=SOCKET`, `device:/dev/tpm0`) [default: device:/dev/tpm0 where the
    /// node has one]. Needs tpm2-tools.
    #[arg(long, value_name = "TCTI")]
    tpm_tcti: Option<String>,
    /// The firmware's measured-boot event log sent with the quote [default:
    /// <root>/sys/kernel/security/tpm0/binary_bios_measurements].
    #[arg(long, value_name = "PATH")]
    tpm_event_log: Option<PathBuf>,
    /// Attest without TPM evidence even where the node has a TPM.
    #[arg(long, conflicts_with = "tpm_tcti")]
    no_tpm: bool,
    #[command(subcommand)]
    stage: Option<StageOne>,
}

/// The two steps of a two-stage boot's stage-1 initramfs (its /init runs them).
#[derive(Debug, clap::Subcommand)]
enum StageOne {
    /// Fetch the root named on the kernel command line (bootfleet.rootfs=, its size and
    /// bootfleet.verity=), check its sha256, put it under dm-verity and print the device
    /// to mount. On failure the boot fails attestation with the reason.
    Stage1 {
        /// Where the root's blob is kept (tmpfs: RAM).
        #[arg(long)]
        dir: PathBuf,
        /// A mounted file system of the node's that keeps the root for the next boot.
        #[arg(long)]
        cache: Option<PathBuf>,
    },
    /// Tell the server why stage 1 stopped (the boot fails attestation with REASON).
    Stage1Fail {
        /// What went wrong, in a line.
        reason: String,
    },
    /// Fetch this node's overlay files from the server and write them under DIR.
    Stage1Overlay {
        /// The new root (its writable layer takes the files).
        #[arg(long)]
        into: PathBuf,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    let cmdline = std::fs::read_to_string(args.root.join("proc/cmdline")).unwrap_or_default();
    let p = boot_params::parse(&cmdline);
    let root_blob = bootfleet_agent::stage1::root::RootBlob::from_params(&p);
    let missing = |what: &str| {
        eprintln!(
            "bootfleet-agent: no {what}: not on the kernel command line (bootfleet.{what}=) nor given as --{what}"
        );
        ExitCode::from(2)
    };
    let Some(server) = args.server.or(p.server) else {
        return missing("server");
    };
    let trusted = match trusted_cas(args.ca_file.as_deref()) {
        Ok(certs) => certs,
        Err(why) => {
            eprintln!("bootfleet-agent: {why}");
            return ExitCode::from(2);
        }
    };
    let Some(boot) = args.boot.or(p.boot) else {
        return missing("boot");
    };
    let Some(token) = args.token.or(p.token) else {
        return missing("token");
    };
    let Some(image) = args.image.and_then(|i| i.parse().ok()).or(p.image) else {
        return missing("image");
    };
    let Some(mac) = args.mac.and_then(|m| m.parse().ok()).or(p.mac) else {
        return missing("mac");
    };
    let stage = args.stage;
    let gpus: Box<dyn GpuSource + Send + Sync> = match args.gpu_readings {
        Some(path) => Box::new(Recorded(path)),
        None => Box::new(Nvml),
    };
    let tpm = tpm_choice(&args.root, args.no_tpm, args.tpm_tcti, args.tpm_event_log);
    let agent = Agent {
        http: {
            // reqwest is built with rustls and no provider of its own (see the server's
            // http_client); the agent installs the same one. An initramfs has no system
            // CA store, and the platform verifier refuses to build without one: the agent
            // trusts the CA it is given (--ca-file) for an https:// server, else none.
            let _ = rustls::crypto::ring::default_provider().install_default();
            reqwest::Client::builder().tls_certs_only(trusted.clone())
        }
        .timeout(Duration::from_secs(30))
        // No connection kept between calls: they are seconds (the GPU checks between
        // attest and validate) to a heartbeat period (30 s) apart, and a kept one would
        // hold one of the server's connection slots meanwhile, while a storm's booting
        // nodes wait for them (and race the server's keep-alive close at 30 s).
        .pool_max_idle_per_host(0)
        .build()
        .expect("HTTP client builds"),
        servers: bootfleet_agent::run::Servers::new(&server, &p.servers),
        boot,
        token,
        mac,
        image,
        root: args.root,
        gpus,
        heartbeat_every: Duration::from_secs(args.heartbeat_secs.max(1)),
        dcgm_level: args.dcgm_level.or(p.dcgm),
        probe: args
            .probe
            .map(|c| (c, Duration::from_secs(args.probe_timeout_secs))),
        figures: args.figures,
        ib_peers: args.ib_peers,
        tpm,
        baseline_modules: Default::default(),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime builds");
    match stage {
        Some(StageOne::Stage1 { dir, cache }) => {
            return runtime.block_on(stage1(&agent, root_blob, &dir, cache.as_deref(), trusted));
        }
        Some(StageOne::Stage1Overlay { into }) => return runtime.block_on(overlay(&agent, &into)),
        Some(StageOne::Stage1Fail { reason }) => {
            return match runtime.block_on(agent.attest_stage1_failure(reason)) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("bootfleet stage 1: could not tell the server: {e}");
                    ExitCode::from(1)
                }
            };
        }
        None => {}
    }
    match runtime.block_on(agent.run(args.once)) {
        Ok(Outcome::Done) => ExitCode::SUCCESS,
        Ok(Outcome::Reboot) if args.no_reboot => {
            eprintln!("bootfleet-agent: the server asks for a reboot (--no-reboot: exiting 3)");
            ExitCode::from(3)
        }
        Ok(Outcome::Reboot) => {
            eprintln!("bootfleet-agent: the server asks for a reboot; rebooting");
            // busybox and systemd both have `reboot -f`; sysrq is the last resort.
            let done = std::process::Command::new("reboot").arg("-f").status();
            if done.map(|s| s.success()).unwrap_or(false) {
                return ExitCode::SUCCESS;
            }
            let _ = std::fs::write("/proc/sysrq-trigger", "b");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("bootfleet-agent: {e}");
            ExitCode::from(2)
        }
    }
}

/// The CA certificates in `path`, if given.
fn trusted_cas(path: Option<&std::path::Path>) -> Result<Vec<reqwest::Certificate>, String> {
    let Some(path) = path else {
        return Ok(Vec::new());
    };
    let pem = std::fs::read(path)
        .map_err(|e| format!("cannot read --ca-file {}: {e}", path.display()))?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem)
        .map_err(|e| format!("--ca-file {}: not a PEM bundle: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("--ca-file {} holds no certificate", path.display()));
    }
    Ok(certs)
}

/// `stage1`: the root fetched, verified and under dm-verity; its device on stdout.
async fn stage1(
    agent: &Agent,
    blob: Result<bootfleet_agent::stage1::root::RootBlob, String>,
    dir: &std::path::Path,
    cache: Option<&std::path::Path>,
    trusted: Vec<reqwest::Certificate>,
) -> ExitCode {
    use bootfleet_agent::stage1::root;
    let outcome = async {
        let blob = blob?;
        // No overall timeout: a root of several GiB takes minutes; stalls are caught by
        // the fetch's own stall timeout.
        let client = reqwest::Client::builder()
            .tls_certs_only(trusted)
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| e.to_string())?;
        root::prepare(
            &client,
            agent.servers.current(),
            &agent.boot,
            &blob,
            dir,
            cache,
        )
        .await
        .map_err(|e| e.to_string())
    }
    .await;
    match outcome {
        Ok(device) => {
            println!("{}", device.display());
            ExitCode::SUCCESS
        }
        Err(why) => {
            eprintln!("bootfleet stage 1: {why}");
            // The server records where the boot stopped; the node never runs the image.
            if let Err(e) = agent.attest_stage1_failure(why).await {
                eprintln!("bootfleet stage 1: could not tell the server: {e}");
            }
            ExitCode::from(1)
        }
    }
}

/// `stage1-overlay`: this node's files from the server, written under `into`.
async fn overlay(agent: &Agent, into: &std::path::Path) -> ExitCode {
    match agent.overlay().await {
        Ok(bytes) => match bootfleet_agent::stage1::overlay::apply(&bytes, into) {
            Ok(files) => {
                eprintln!(
                    "bootfleet stage 1: overlay of {} files applied",
                    files.len()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("bootfleet stage 1: {e}");
                ExitCode::from(1)
            }
        },
        Err(e) => {
            eprintln!("bootfleet stage 1: overlay: {e}");
            ExitCode::from(1)
        }
    }
}

/// `NAME=COMMAND`, NAME a figure's name (letters, digits, `_`, at most 64).
fn figure_arg(s: &str) -> Result<(String, String), String> {
    let (name, command) = s
        .split_once('=')
        .ok_or("expected NAME=COMMAND (gemm_tflops='...')")?;
    let named = !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !named || command.trim().is_empty() {
        return Err(format!(
            "{s:?}: NAME is letters, digits and _, and COMMAND is not empty"
        ));
    }
    Ok((name.to_string(), command.to_string()))
}

/// The TPM the agent attests with: the one named, else the node's own where it has
/// one. On a real node (root `/`) securityfs is mounted for the event log if it is not.
fn tpm_choice(
    root: &std::path::Path,
    off: bool,
    tcti: Option<String>,
    log: Option<PathBuf>,
) -> Option<(String, PathBuf)> {
    use bootfleet_agent::tpm::{DEVICE_TCTI, EVENT_LOG};
    if off {
        return None;
    }
    let tcti = match tcti {
        Some(t) => t,
        None if root.join("dev/tpm0").exists() => DEVICE_TCTI.to_string(),
        None => return None,
    };
    let log = log.unwrap_or_else(|| root.join(EVENT_LOG));
    if root == std::path::Path::new("/") && !log.exists() {
        bootfleet_agent::tpm::mount_securityfs();
    }
    Some((tcti, log))
}
