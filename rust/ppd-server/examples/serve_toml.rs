//! `ppd-server` without Python: runs the router from a TOML file until SIGINT/SIGTERM.
//!
//! For profiling the per-request path with native tools (callgrind, perf), which
//! see through a plain binary more easily than through the Python CLI:
//!
//!     cargo build --release -p ppd-server --example serve_toml
//!     valgrind --tool=callgrind target/release/examples/serve_toml router.toml

fn main() {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: serve_toml CONFIG.toml");
        std::process::exit(2);
    };
    let settings = match ppd_server::RouterConfig::from_toml_file(std::path::Path::new(&path))
        .and_then(ppd_server::RouterConfig::validate)
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = ppd_server::serve_blocking(settings) {
        eprintln!("ppd-router: {e}");
        std::process::exit(1);
    }
}
