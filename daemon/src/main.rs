//! `kvmeshd`: runs the daemon on the embedded default config, or on
//! `--config FILE`.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use clap::Parser;
use kvmeshd::Config;

/// kvmesh daemon: shares KV-cache blocks with co-located inference engines.
#[derive(Parser)]
#[command(version, about)]
struct Args {
    /// TOML configuration file (default: the embedded default config).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Override the engine socket path.
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Print the embedded default configuration and exit.
    #[arg(long)]
    print_default_config: bool,
    /// Check the configuration and exit.
    #[arg(long)]
    check_config: bool,
    /// Print the RDMA devices and ports found, and exit.
    #[arg(long)]
    print_topology: bool,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if args.print_default_config {
        print!("{}", kvmeshd::config::DEFAULT_CONFIG);
        return std::process::ExitCode::SUCCESS;
    }
    if args.print_topology {
        print!("{}", kvmesh_rdma::report());
        if !kvmesh_rdma::report().ends_with('\n') {
            println!();
        }
        return std::process::ExitCode::SUCCESS;
    }
    let cfg = match &args.config {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read config {}: {e}", path.display()))
            .and_then(|text| Config::parse(&text, &path.display().to_string())),
        None => Ok(Config::default_config()),
    };
    let mut cfg = match cfg {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvmeshd: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    if let Some(s) = &args.socket {
        cfg.server.socket = Some(s.clone());
    }
    if args.check_config {
        // The TLS files too, as start-up loads them.
        if let Err(e) = kvmeshd::server::check_files(&cfg) {
            eprintln!("kvmeshd: {e}");
            return std::process::ExitCode::from(2);
        }
        println!("configuration ok");
        return std::process::ExitCode::SUCCESS;
    }
    // UCX's tcp settings, before any thread starts (see the function);
    // only where tcp may be used (UCX warns of unused variables).
    let tuned = match cfg.peer.transports.as_str() {
        "sm" => Ok(Vec::new()),
        t => kvmesh_ucx::tune_environment(t == "tcp"),
    };
    // Logs: KVMESH_LOG overrides [log] filter; the filter is reloadable.
    use tracing_subscriber::prelude::*;
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVMESH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cfg.log.filter));
    let (filter, filter_handle) = tracing_subscriber::reload::Layer::new(filter);
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry().with(filter);
    if cfg.log.format == "json" {
        registry.with(fmt.json().with_ansi(false)).init();
    } else {
        registry.with(fmt.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))).init();
    }
    // A panic anywhere (a tokio task included, whose panic would otherwise
    // end only that task) aborts the process: state half-changed by the
    // panicking code is never served. systemd restarts the daemon; peers
    // see a new incarnation and drop what they knew of the old one.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        // Plain stderr, not tracing: the panic may be inside the logger.
        eprintln!("kvmeshd: panic: {info}; aborting (no half-applied state is served; a restart is safe)");
        std::process::abort();
    }));
    match &tuned {
        Ok(set) if !set.is_empty() => tracing::info!(?set, "UCX settings tuned (docs/OPERATING.md, Data plane)"),
        Ok(_) => {}
        Err(e) => tracing::warn!("UCX settings not tuned: {e}"),
    }
    let reload = args.config.clone().map(|path| kvmeshd::server::Reload {
        path,
        socket_override: args.socket.clone(),
        set_log_filter: Box::new(move |f: &str| {
            let new = tracing_subscriber::EnvFilter::try_new(f).map_err(|e| e.to_string())?;
            filter_handle.reload(new).map_err(|e| e.to_string())
        }),
    });
    let workers = match cfg.server.worker_threads {
        0 => std::thread::available_parallelism().map_or(2, |n| n.get()).min(4),
        n => n as usize,
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .thread_name("kvmeshd")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvmeshd: cannot start runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(kvmeshd::server::run_with(cfg, std::future::pending(), true, reload)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvmeshd: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
