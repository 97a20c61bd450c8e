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
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("cannot read {path}: {e}");
            std::process::exit(2);
        }
    };
    let cfg = match ppd_server::RouterConfig::from_toml(&text) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{path}: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = ppd_server::serve_blocking(cfg) {
        eprintln!("ppd-router: {e}");
        std::process::exit(1);
    }
}
