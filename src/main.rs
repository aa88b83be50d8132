//! The `bootfleet` binary: server and admin CLI in one.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = bootfleet::cli::Cli::parse();
    match bootfleet::cli::run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
