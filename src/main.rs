//! The `bootfleet` binary: server and admin CLI in one.

fn main() -> std::process::ExitCode {
    // Before the runtime's threads: they would each take a glibc arena of their own.
    bootfleet::heap::limit_arenas();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("the tokio runtime starts")
        .block_on(run())
}

async fn run() -> std::process::ExitCode {
    let cli = bootfleet::cli::parse();
    if !matches!(cli.command, bootfleet::cli::Command::Serve(_)) {
        quiet_on_closed_pipe();
    }
    if matches!(cli.command, bootfleet::cli::Command::Openapi) {
        // The document the routes are declared with, so the server's own.
        use std::io::Write;
        let printed = std::io::stdout().write_all(bootfleet::http::openapi_json().as_bytes());
        return match printed {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    let output = cli.output;
    match bootfleet::cli::run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let (code, class, status) = bootfleet::cli::client::classify(&e);
            if output == bootfleet::cli::OutputFormat::Json {
                let error = serde_json::json!({ "error": format!("{e:#}"), "class": class, "status": status });
                eprintln!("{error}");
            } else {
                eprintln!("error: {e:#}");
            }
            std::process::ExitCode::from(code)
        }
    }
}

/// Admin commands end quietly when their reader goes away (`bootfleet node show | head`),
/// as Unix tools do: Rust ignores SIGPIPE, which turns a closed pipe into a panic at the
/// next print. Never for `serve`: a server must outlive a peer that closed its socket.
fn quiet_on_closed_pipe() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    // SAFETY: SIG_DFL installs no handler code, so nothing runs in signal context; the
    // disposition is process-wide, which is what an admin command wants.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
}
