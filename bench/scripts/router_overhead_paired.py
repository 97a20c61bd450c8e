"""Added TTFT of the router, measured in pairs: the routed load and a direct probe run at the same time.

Why paired: on this shared 2-core machine the TTFT of one 8-second run drifts by more than the
router adds (direct p99 moved between 9 and 20 ms from one run to the next), so subtracting
percentiles of runs taken minutes apart (``router_overhead.py``) mixes machine drift into the
result. Here each measurement runs two open-loop load generators concurrently against the same
emulator nodes: the routed target at the full rate R, and its baseline at ``--probe-share`` x R.
Both see the same node load and the same machine weather; the added TTFT is the difference of
their percentiles in that one window (the median over repetitions is reported).

Pairs (routed target vs its baseline):

  relay_t2      vs direct_t2     bare TCP relay in front of the pD node (ppd-server's tcp_relay
                                 example): the floor that any proxy process adds on this machine
  nginx_local_t2 vs direct_t2    nginx (Debian's package: apt-get install nginx-light) proxying to
                                 the pD node: keep-alive pool of 64 upstream connections, no
                                 buffering, 2 workers, no access log
  smg_local_t2  vs direct_t2     SGLang's gateway (PyPI smg) over the pD node, round robin
  vllm_local_t2 vs direct_t2     PyPI vllm-router over the pD node, round robin
  ppd_local_t2  vs direct_t2     ppd-router serve, path local, default runtime (thread-per-core)
  ws_local_t2   vs direct_t2     ppd-router serve --runtime work-stealing, path local
  one_local_t2  vs direct_t2     ppd-router serve --worker-threads 1 (one I/O thread), path local
  ppd_pd_t1     vs client_pd_t1  ppd-router, path pd (P then D), vs the NIXL exchange done by
                                 the load generator itself (a zero-cost router)
  vllm_pd_t1    vs client_pd_t1  PyPI vllm-router --vllm-pd-disaggregation on the same nodes
  smg_pd_t1     vs client_pd_t1  smg --pd-disaggregation (its SGLang protocol: P and D called at
                                 once) on the same nodes
  b_local_t2    vs direct_t2     with --router-b: a second ppd-router build (its serve_toml
  b_pd_t1       vs client_pd_t1  example), local and pd paths, for an old-vs-new comparison

It also reports the CPU each router process (with its children: nginx's workers) spent per
request it served in the window, and the ratios of ppd-router to each peer in the same run.
Every peer logs at warning level or not at all, as ppd-router does by default.

    . .venv/bin/activate
    cargo build --release -p ppd-server --example tcp_relay
    python bench/scripts/router_overhead_paired.py --rates 500 2000 --reps 5 --duration 8 \
        --out bench/results/overhead-paired.json
    python bench/scripts/router_overhead_paired.py --report bench/results/overhead-paired.json
    # where the CPU per request goes (syscalls, switches, user / kernel time), nginx beside each build
    python bench/scripts/router_overhead_paired.py --kernel-split target/release/examples/serve_toml --reps 3 --duration 6

Every process started here is stopped at the end; vllm-router and smg come from .venv-bench
(python -m venv .venv-bench && .venv-bench/bin/pip install vllm-router smg), nginx from PATH or
/usr/sbin; a peer that is not installed is left out of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from router_overhead import (  # the sibling script's process and load helpers
    LOADGEN,
    WARMUP,
    Procs,
    bodies,
    build_info,
    build_loadgen,
    cpu_seconds,
    free_port,
    loadavg,
    loadgen_argv,
    start_nodes,
    start_router_b,
    start_vllm_router,
    wait_http,
)

ROOT = Path(__file__).resolve().parents[2]
RELAY = ROOT / "target" / "release" / "examples" / "tcp_relay"
PAIRS = [
    ("relay_t2", "direct_t2"),
    ("nginx_local_t2", "direct_t2"),
    ("ppd_local_t2", "direct_t2"),
    ("ws_local_t2", "direct_t2"),
    ("one_local_t2", "direct_t2"),
    ("smg_local_t2", "direct_t2"),
    ("vllm_local_t2", "direct_t2"),
    ("ppd_pd_t1", "client_pd_t1"),
    ("vllm_pd_t1", "client_pd_t1"),
    ("smg_pd_t1", "client_pd_t1"),
    ("b_local_t2", "direct_t2"),
    ("b_pd_t1", "client_pd_t1"),
]
# Targets measured only when named in --pairs.
ON_REQUEST = ("ws_local_t2", "one_local_t2", "b_local_t2", "b_pd_t1")
# ppd-router ÷ each peer, per path: (ppd-router's target, the peers' targets).
PEERS = [("ppd_local_t2", ["relay_t2", "nginx_local_t2", "smg_local_t2", "vllm_local_t2"]),
         ("ppd_pd_t1", ["vllm_pd_t1", "smg_pd_t1"])]
# ppd-router instances: key -> extra `serve` flags
PPD_ROUTERS = {"ppd": [], "ws": ["--runtime", "work-stealing"], "one": ["--worker-threads", "1"]}
ROUTER_OF = {"relay_t2": "relay", "nginx_local_t2": "nginx", "ppd_local_t2": "ppd", "ws_local_t2": "ws",
             "one_local_t2": "one", "smg_local_t2": "smg_local", "vllm_local_t2": "vllm_local",
             "ppd_pd_t1": "ppd", "vllm_pd_t1": "vllm", "smg_pd_t1": "smg_pd", "b_local_t2": "b", "b_pd_t1": "b"}


def user_sys_seconds(pids: list[int]) -> tuple[float, float]:
    """utime and stime of these processes (all their threads), from /proc."""
    tck = os.sysconf("SC_CLK_TCK")
    user = kernel = 0.0
    for p in pids:
        f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        user += int(f[11]) / tck
        kernel += int(f[12]) / tck
    return user, kernel


def kernel_split(args: argparse.Namespace, builds: list[str]) -> None:
    """Where a proxy's CPU per request goes: the same Turn-2 load through nginx and each router build in
    turn (same nodes, same run), with `perf stat` counting the proxy's syscalls and context switches and
    /proc its user and kernel time. Counts do not depend on the machine's load; the times do, so compare
    them within a repetition."""
    build_loadgen()
    tmp = Path(tempfile.mkdtemp(prefix="kernel-split-"))
    procs = Procs(tmp)
    targets = ["nginx", *[f"r{i}" for i in range(len(builds))]]
    port = {k: free_port() for k in ("P", "D", *targets)}
    url = {k: f"http://127.0.0.1:{v}" for k, v in port.items()}
    ppd = str(Path(sys.executable).parent / "ppd-router")
    events = "raw_syscalls:sys_enter,context-switches"
    print("| rep | rate/s | target | requests | syscalls / req | switches / req | user µs / req | kernel µs / req | load |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    try:
        start_nodes(procs, ppd, port, url)
        t1, t2 = bodies(tmp, args.max_tokens, url["D"])
        pid = {"nginx": start_nginx(procs, args.nginx, tmp, url, port["nginx"])[0]}
        for i, b in enumerate(builds):
            cfg = tmp / f"r{i}.toml"
            cfg.write_text(f'port = {port[f"r{i}"]}\nprefill = ["{url["P"]}"]\npd_capable = ["{url["D"]}"]\n'
                           'policy = "local"\n')
            r = procs.start(f"r{i}", [*b.split(), str(cfg)])
            wait_http(url[f"r{i}"] + "/health", 60, r)
            pid[f"r{i}"] = r.pid
        for rep in range(args.reps):
            for rate in args.rates:
                for name in targets:
                    base = [str(LOADGEN), "--target", url[name], "--body", str(t2), "--sessions", "64",
                            "--session-prefix", f"{name}-{rep}-{rate}-", "--timeout", "20", "--rate", str(rate)]
                    subprocess.run([*base, "--duration", "1", "--prime-body", str(t1), "--warmup", "50"],
                                   check=True, capture_output=True)
                    kids = Path(f"/proc/{pid[name]}/task/{pid[name]}/children").read_text().split()
                    pids = [pid[name], *map(int, kids)]
                    perf = subprocess.Popen(["perf", "stat", "-x,", "-e", events, "-p", ",".join(map(str, pids))],
                                            stderr=subprocess.PIPE, text=True)
                    time.sleep(0.2)
                    u0, k0 = user_sys_seconds(pids)
                    m = json.loads(subprocess.run([*base, "--duration", str(args.duration), "--warmup", "0"],
                                                  check=True, capture_output=True, text=True).stdout)
                    u1, k1 = user_sys_seconds(pids)
                    perf.send_signal(signal.SIGINT)
                    counts = {f[2]: float(f[0]) for f in (x.split(",") for x in perf.communicate()[1].splitlines())
                              if len(f) > 2 and f[0].replace(".", "").isdigit()}
                    n = max(m["ok"], 1)
                    who = "nginx" if name == "nginx" else builds[int(name[1:])]
                    print(f"| {rep + 1} | {rate:g} | {who} | {m['ok']} | {counts.get('raw_syscalls:sys_enter', 0) / n:.2f} "
                          f"| {counts.get('context-switches', 0) / n:.2f} | {(u1 - u0) / n * 1e6:.0f} "
                          f"| {(k1 - k0) / n * 1e6:.0f} | {loadavg()} |", flush=True)
    finally:
        procs.stop_all()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--rates", type=float, nargs="+", default=[500.0, 2000.0], help="routed rates, req/s")
    ap.add_argument("--probe-share", type=float, default=0.25, help="baseline rate as a share of the routed rate")
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pairs", nargs="*", default=[p[0] for p in PAIRS if p[0] not in ON_REQUEST],
                    help=f"routed targets to measure ({', '.join(ON_REQUEST)} only when named; b_* with --router-b)")
    ap.add_argument("--router-b", help="a second router build, run as `ROUTER_B CONFIG.toml` (the serve_toml "
                    "example of ppd-server); measured as b_local_t2 and b_pd_t1 when named in --pairs")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--vllm-router", default=str(ROOT / ".venv-bench" / "bin" / "vllm-router"))
    ap.add_argument("--smg", default=str(ROOT / ".venv-bench" / "bin" / "smg"))
    ap.add_argument("--nginx", default=shutil.which("nginx") or "/usr/sbin/nginx")
    ap.add_argument("--out")
    ap.add_argument("--report", metavar="JSON", help="print the tables of a saved run and exit")
    ap.add_argument("--kernel-split", nargs="+", metavar="BUILD",
                    help="instead: per request, the syscalls, context switches and user / kernel CPU of nginx and "
                    "of each router build (`BUILD CONFIG.toml`, e.g. the serve_toml example) on the local path, "
                    "at each of --rates for --duration s, --reps times (perf stat and /proc)")
    args = ap.parse_args()
    if args.report:
        report(json.loads(Path(args.report).read_text()))
        return
    if args.kernel_split:
        kernel_split(args, args.kernel_split)
        return

    build_loadgen()
    if not RELAY.exists():
        raise SystemExit(f"{RELAY} missing: cargo build --release -p ppd-server --example tcp_relay")
    ppd = str(Path(sys.executable).parent / "ppd-router")
    installed = {"vllm": Path(args.vllm_router).exists(), "smg": Path(args.smg).exists(),
                 "nginx": Path(args.nginx).exists(), "b": bool(args.router_b)}
    pairs = [p for p in PAIRS if p[0] in args.pairs
             and installed.get(ROUTER_OF[p[0]].split("_")[0], True)]
    missing = sorted({ROUTER_OF[p] for p in args.pairs} - {ROUTER_OF[p[0]] for p in pairs})
    if missing:
        print(f"left out (not installed): {', '.join(missing)}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="router-overhead-paired-"))
    procs = Procs(tmp)
    port = {k: free_port() for k in ("P", "D", *PPD_ROUTERS, "vllm", "relay", "b", "nginx", "smg_local",
                                     "smg_pd", "vllm_local", "metrics_a", "metrics_b", "metrics_c")}
    url = {k: f"http://127.0.0.1:{v}" for k, v in port.items()}
    results: dict = {"runs": [], "meta": {
        "rates": args.rates, "probe_share": args.probe_share, "duration_s": args.duration, "reps": args.reps,
        "max_tokens": args.max_tokens, "nproc": os.cpu_count(),
        "start_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "logs": str(tmp), "build": build_info(),
        "argv": sys.argv}}
    try:
        pid = start_nodes(procs, ppd, port, url)
        t1, t2 = bodies(tmp, args.max_tokens, url["D"])
        for key in {ROUTER_OF[p[0]] for p in pairs} & PPD_ROUTERS.keys():
            r = procs.start(f"router-{key}", [ppd, "serve", "--prefill", url["P"], "--pd-capable", url["D"],
                                              "--policy", "local", *PPD_ROUTERS[key], "--port", str(port[key])])
            wait_http(url[key] + "/health", 30, r)
            pid[key] = r.pid
        relay = procs.start("relay", [str(RELAY), str(port["relay"]), f"127.0.0.1:{port['D']}"])
        wait_http(url["relay"] + "/health", 30, relay)
        pid["relay"] = relay.pid
        if any(p[0].startswith("b_") for p in pairs):
            pid["b"] = start_router_b(procs, args.router_b, tmp, url, port["b"])
            results["meta"]["router_b"] = args.router_b
        used = {ROUTER_OF[p[0]] for p in pairs}
        if "vllm" in used:
            pid["vllm"], results["meta"]["vllm_router_version"] = start_vllm_router(
                procs, args.vllm_router, url, port["vllm"])
        if "vllm_local" in used:
            pid["vllm_local"], results["meta"]["vllm_router_version"] = start_peer(
                procs, "vllm-router-local", [args.vllm_router, "--worker-urls", url["D"], "--policy", "round_robin",
                                             "--log-level", "warning", "--prometheus-host", "127.0.0.1",
                                             "--prometheus-port", str(port["metrics_a"])],
                port["vllm_local"], "vllm-router")
        for key, mode in (("smg_local", ["--worker-urls", url["D"]]),
                          ("smg_pd", ["--pd-disaggregation", "--prefill", url["P"], "--decode", url["D"]])):
            if key in used:
                metrics = port["metrics_b" if key == "smg_local" else "metrics_c"]
                pid[key], results["meta"]["smg_version"] = start_peer(
                    procs, key, [args.smg, "launch", *mode, "--policy", "round_robin", "--log-level", "warn",
                                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)],
                    port[key], "smg")
        if "nginx" in used:
            pid["nginx"], results["meta"]["nginx_version"] = start_nginx(procs, args.nginx, tmp, url, port["nginx"])

        def argv_for(target: str, rate: float, seed: int) -> list[str]:
            router = ROUTER_OF.get(target)
            # relay_t2 is not primed: the bare relay holds no sessions.
            return loadgen_argv(target, url[router] if router else None, url, rate, args.duration, args.timeout,
                                seed, (t1, t2), args.sessions, prime=router in PPD_ROUTERS,
                                t1_prefix=f"{target}-{seed}-")

        def pair(routed: str, base: str, rate: float, seed: int) -> dict:
            router = ROUTER_OF[routed]
            argvs = {"routed": argv_for(routed, rate, seed),
                     "base": argv_for(base, rate * args.probe_share, seed + 1)}
            c0 = cpu_seconds(pid[router])
            la0 = loadavg()
            running = {k: subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                       for k, a in argvs.items()}
            out = {}
            for k, p in running.items():
                stdout, stderr = p.communicate(timeout=args.duration + args.timeout + 120)
                if p.returncode != 0:
                    raise SystemExit(f"loadgen {k} failed ({p.returncode}): {stderr[-2000:]}")
                out[k] = json.loads(stdout)
            for key, p_id in pid.items():
                if any(p.pid == p_id and p.poll() is not None for p in procs.procs):
                    raise SystemExit(f"{key} exited during the run; logs in {tmp}")
            served = out["routed"]["sent"] + WARMUP + (args.sessions if "--prime-body" in argvs["routed"] else 0)
            cpu = cpu_seconds(pid[router]) - c0
            return {"routed": routed, "base": base, "rate": rate, "seed": seed,
                    "router_cpu_s": round(cpu, 3), "router_cpu_us_per_req": round(1e6 * cpu / served, 1),
                    "loadavg_before_after": [la0, loadavg()], "argv": argvs,
                    "routed_summary": out["routed"], "base_summary": out["base"]}

        for rep in range(args.reps):
            for rate in args.rates:
                order = pairs[rep % len(pairs):] + pairs[:rep % len(pairs)]  # no target always first
                for i, (routed, base) in enumerate(order):
                    r = pair(routed, base, rate, seed=10_000 * rep + 100 * i + int(rate))
                    r["rep"] = rep
                    results["runs"].append(r)
                    print(line(r), flush=True)
    finally:
        procs.stop_all()
        results["meta"]["end_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
    report(results)


def start_peer(procs: Procs, name: str, argv: list[str], port: int, package: str) -> tuple[int, str]:
    """A PyPI router (vllm-router, smg) on 127.0.0.1:`port`; returns its pid once healthy and its version."""
    p = procs.start(name, [*argv, "--host", "127.0.0.1", "--port", str(port)])
    wait_http(f"http://127.0.0.1:{port}/health", 90, p)
    version = subprocess.run([str(Path(argv[0]).parent / "python"), "-c",
                              f"import importlib.metadata as m; print(m.version({package!r}))"],
                             capture_output=True, text=True).stdout.strip()
    return p.pid, version


NGINX_CONF = """worker_processes 2;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx-body;
    proxy_temp_path {tmp}/nginx-proxy;
    fastcgi_temp_path {tmp}/nginx-fastcgi;
    uwsgi_temp_path {tmp}/nginx-uwsgi;
    scgi_temp_path {tmp}/nginx-scgi;
    upstream d {{ server {d}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://d;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def start_nginx(procs: Procs, exe: str, tmp: Path, url: dict, port: int) -> tuple[int, str]:
    """nginx proxying 127.0.0.1:`port` to the pD node (the config above); returns its master's pid
    (its workers are its children, whose CPU is counted with it) and its version."""
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, d=url["D"].removeprefix("http://"), port=port))
    p = procs.start("nginx", [exe, "-c", str(conf), "-p", str(tmp)])
    wait_http(f"http://127.0.0.1:{port}/health", 30, p)
    version = subprocess.run([exe, "-v"], capture_output=True, text=True).stderr.strip()
    return p.pid, version.split("/")[-1]


def added(r: dict, q: str) -> float | None:
    a, b = r["routed_summary"]["ttft_us"].get(q), r["base_summary"]["ttft_us"].get(q)
    return None if a is None or b is None else a - b


def line(r: dict) -> str:
    s, b = r["routed_summary"], r["base_summary"]
    return (f"rep {r['rep']} {r['routed']:>12} @ {r['rate']:>5g}/s: ok {s['ok']}/{s['arrivals']} "
            f"p50 {s['ttft_us']['p50']:.0f} p99 {s['ttft_us']['p99']:.0f} | {r['base']} ok {b['ok']}/{b['arrivals']} "
            f"p50 {b['ttft_us']['p50']:.0f} p99 {b['ttft_us']['p99']:.0f} | added p50 {added(r, 'p50'):+.0f} "
            f"p99 {added(r, 'p99'):+.0f} us, router {r['router_cpu_us_per_req']:.0f} us CPU/req, "
            f"paths {s['paths']} errors {s['errors']}")


def ratio_table(runs: list, rates: list, pairs: list, title: str) -> None:
    """Medians of this build over router B's, per routed pair and rate."""
    if not any(r["routed"].startswith("b_") for r in runs):
        return
    print(f"\n{title}")
    print("| routed (this / B) | rate/s | added p50 ratio | added p99 ratio | routed TTFT p50 ratio "
          "| routed TTFT p99 ratio | CPU/req ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for a_name, b_name in pairs:
        for rate in rates:
            if any(r["routed"] == b_name and r["rate"] == rate for r in runs):
                cells = ratio_cells(runs, rate, a_name, b_name)
                print(f"| {a_name} / {b_name} | {rate:g} | " + " | ".join(cells) + " |")


def ratio_cells(runs: list, rate: float, a_name: str, b_name: str) -> list[str]:
    """Medians of target a over those of target b at one rate: added p50 and p99, routed TTFT p50
    and p99, CPU per request."""
    def mv(routed: str, f) -> float:
        return med([f(r) for r in runs if r["routed"] == routed and r["rate"] == rate])
    cells = []
    for f in (lambda r: added(r, "p50"), lambda r: added(r, "p99"),
              lambda r: r["routed_summary"]["ttft_us"]["p50"], lambda r: r["routed_summary"]["ttft_us"]["p99"],
              lambda r: r["router_cpu_us_per_req"]):
        a, b = mv(a_name, f), mv(b_name, f)
        cells.append(f"{a / b:.2f}" if b and b > 0 and a == a else "n/a")
    return cells


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(results: dict) -> None:
    runs = results["runs"]
    m = results["meta"]
    print(f"\nbuild {m['build'].get('head')} (sources dirty: {m['build'].get('rust_sources_dirty')}), "
          f"{m['start_utc']} - {m.get('end_utc')} UTC, {m['reps']} reps x {m['duration_s']} s, "
          f"baseline at {m['probe_share']:g} x the routed rate; vllm-router {m.get('vllm_router_version', '-')}, "
          f"smg {m.get('smg_version', '-')}, nginx {m.get('nginx_version', '-')}")
    print("\nAdded TTFT (routed - baseline in the same window), µs: median over repetitions [min .. max]; "
          "router CPU µs per request; success")
    print("| routed | baseline | rate/s | added p50 | added p99 | routed p50 / p99 | baseline p50 / p99 "
          "| router CPU µs/req | routed ok |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    seen = []
    for r in runs:
        if (r["routed"], r["rate"]) not in seen:
            seen.append((r["routed"], r["rate"]))
    for routed, rate in seen:
        rs = [r for r in runs if r["routed"] == routed and r["rate"] == rate]
        a50 = [added(r, "p50") for r in rs if added(r, "p50") is not None]
        a99 = [added(r, "p99") for r in rs if added(r, "p99") is not None]
        ok = sum(r["routed_summary"]["ok"] for r in rs)
        arr = sum(r["routed_summary"]["arrivals"] for r in rs)
        print(f"| {routed} | {rs[0]['base']} | {rate:g} | {med(a50):+.0f} [{min(a50):+.0f} .. {max(a50):+.0f}] "
              f"| {med(a99):+.0f} [{min(a99):+.0f} .. {max(a99):+.0f}] "
              f"| {med([r['routed_summary']['ttft_us']['p50'] for r in rs]):.0f} / "
              f"{med([r['routed_summary']['ttft_us']['p99'] for r in rs]):.0f} "
              f"| {med([r['base_summary']['ttft_us']['p50'] for r in rs]):.0f} / "
              f"{med([r['base_summary']['ttft_us']['p99'] for r in rs]):.0f} "
              f"| {med([r['router_cpu_us_per_req'] for r in rs]):.0f} | {ok}/{arr} |")
    rates = sorted({r["rate"] for r in runs})
    ratio_table(runs, rates, [("ppd_local_t2", "b_local_t2"), ("ppd_pd_t1", "b_pd_t1")],
                f"this build / router B ({m.get('router_b', '-')}), same nodes, same run (< 1: this build better)")
    peers_table(runs, rates)
    print("\nLoad average (1 min) before and after each pair, per repetition")
    print("| rep | rate/s | load average range |")
    print("|---:|---:|---|")
    for rep in sorted({r["rep"] for r in runs}):
        for rate in rates:
            la = [float(x) for r in runs if r["rep"] == rep and r["rate"] == rate for x in r["loadavg_before_after"]]
            if la:
                print(f"| {rep} | {rate:g} | {min(la):.2f} .. {max(la):.2f} |")


def peers_table(runs: list, rates: list) -> None:
    """ppd-router ÷ each peer on the same path, medians over repetitions of one run (< 1: ppd-router better)."""
    print("\nppd-router / each peer, same nodes, same run: ratios of medians (< 1: ppd-router better)")
    print("| ppd-router / peer | rate/s | added p50 | added p99 | routed TTFT p50 | routed TTFT p99 | CPU/req |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for ours, peers in PEERS:
        for peer in peers:
            for rate in rates:
                if any(r["routed"] == peer and r["rate"] == rate for r in runs):
                    print(f"| {ours} / {peer} | {rate:g} | " + " | ".join(ratio_cells(runs, rate, ours, peer)) + " |")

if __name__ == "__main__":
    main()
