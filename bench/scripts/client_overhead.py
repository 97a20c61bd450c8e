"""Measure the bench client's own overhead against the stub streaming server.

Starts ``python -m ppd_router.bench.stub_server`` (fixed TTFT and inter-token
interval, no model work) as its own process, then runs ``ppd-router bench
--json`` at each requested QPS and prints a markdown table: peak concurrent
streams, measured TTFT and TPOT against the stub's fixed values (the excess is
client + server + loopback overhead, an upper bound on the client's), the
client's and the server's CPU use, and the arrival-schedule lag.

    python bench/scripts/client_overhead.py --qps 2 40 --duration 15
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def _cpu_seconds(pid: int) -> float:
    # utime + stime of a process, from /proc (Linux).
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, deadline: float) -> None:
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("stub server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--qps", type=float, nargs="+", default=[2.0, 40.0])
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--workload", default="small_short_gen")
    ap.add_argument("--ttft-ms", type=float, default=50.0)
    ap.add_argument("--itl-ms", type=float, default=50.0)
    args = ap.parse_args()
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "ppd_router.bench.stub_server", "--port", str(port),
         "--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms)],
        stdout=subprocess.DEVNULL)
    rows = []
    try:
        _wait_listening(port, time.time() + 15)
        for qps in args.qps:
            s0 = _cpu_seconds(server.pid)
            t0 = time.time()
            out = subprocess.run(
                [sys.executable, "-m", "ppd_router.cli", "bench", "--target",
                 f"http://127.0.0.1:{port}", "--workload", args.workload, "--qps", str(qps),
                 "--duration", str(args.duration), "--json"],
                check=True, capture_output=True, text=True).stdout
            wall = time.time() - t0
            s = json.loads(out)
            rows.append((qps, s, _cpu_seconds(server.pid) - s0, wall))
    finally:
        server.terminate()
        server.wait(10)
    print(f"stub: TTFT {args.ttft_ms:g} ms, inter-token {args.itl_ms:g} ms; workload "
          f"{args.workload}, {args.duration:g} s of arrivals\n")
    print("| QPS | requests ok/all | peak concurrent streams | SSE events/s | TTFT p50 / p99 ms "
          "| TPOT p50 / p99 ms | client CPU s (% of run) | client CPU µs/event "
          "| server CPU s | client loop lag p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for qps, s, server_cpu, _wall in rows:
        o, c = s["overall"], s["client"]
        dur = s["duration_sec"]
        print(f"| {qps:g} | {o['count']}/{o['requests']} | {c['peak_concurrent_requests']} "
              f"| {c['sse_events'] / dur:,.0f} "
              f"| {o['p50_ttft_ms']:.1f} / {o['p99_ttft_ms']:.1f} "
              f"| {o['p50_tpot_ms']:.2f} / {o['p99_tpot_ms']:.2f} "
              f"| {c['cpu_seconds']:.1f} ({100 * c['cpu_seconds'] / dur:.0f}%) "
              f"| {1e6 * c['cpu_seconds'] / max(1, c['sse_events']):.0f} "
              f"| {server_cpu:.1f} | {c['loop_lag_p50_ms']:.2f} / {c['loop_lag_p99_ms']:.2f} |")


if __name__ == "__main__":
    main()
