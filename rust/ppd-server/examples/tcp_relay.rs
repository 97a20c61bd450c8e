//! The floor under any proxy on this machine, for bench/scripts/router_overhead_paired.py: a bare
//! TCP relay (no HTTP parsing, no routing) that copies each accepted connection to one
//! upstream. Whatever it adds over calling the node directly, every router adds too.
//!
//!     tcp_relay LISTEN_PORT UPSTREAM_HOST:PORT [THREADS]

use tokio::net::{TcpListener, TcpStream};

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: tcp_relay LISTEN_PORT UPSTREAM_HOST:PORT [THREADS]");
        std::process::exit(2);
    }
    let port: u16 = args[1].parse().map_err(std::io::Error::other)?;
    let upstream = args[2].clone();
    let threads: usize = args
        .get(3)
        .map_or(Ok(0), |t| t.parse())
        .map_err(std::io::Error::other)?;
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if threads > 0 {
        rt.worker_threads(threads);
    }
    rt.enable_all().build()?.block_on(async move {
        let listener = TcpListener::bind(("127.0.0.1", port)).await?;
        loop {
            let (mut client, _) = listener.accept().await?;
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let _ = client.set_nodelay(true);
                let Ok(mut server) = TcpStream::connect(&upstream).await else {
                    return;
                };
                let _ = server.set_nodelay(true);
                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            });
        }
    })
}
