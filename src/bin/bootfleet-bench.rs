//! `bootfleet-bench`: the load generators and the boot-storm simulator behind
//! BENCHMARKS.md, a client of a running server (see `bootfleet::storm`).

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "bootfleet-bench",
    version,
    about = "Load generators for bootfleet's benchmarks: TFTP clients, the HTTP phase and its bound, and the boot-storm simulator"
)]
struct Args {
    /// Server URL (storm-setup publishes and assigns through the admin API).
    #[arg(long, global = true, env = "BOOTFLEET_SERVER", default_value = bootfleet::config::DEFAULT_SERVER_URL)]
    server: String,
    /// Admin bearer token (default: read <data-dir>/admin.token).
    #[arg(long, global = true, env = "BOOTFLEET_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The server's data directory, for its token file [default: ./bootfleet-data].
    #[arg(long, global = true, env = "BOOTFLEET_DATA_DIR")]
    data_dir: Option<std::path::PathBuf>,
    /// Output format.
    #[arg(long, global = true, value_enum, default_value_t = bootfleet::cli::OutputFormat::Text)]
    output: bootfleet::cli::OutputFormat,
    #[command(subcommand)]
    command: bootfleet::storm::bench::BenchCommand,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let result = bootfleet::storm::bench::run(
        args.command,
        args.output,
        &args.server,
        args.token,
        args.data_dir.as_deref(),
    )
    .await;
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
