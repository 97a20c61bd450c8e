"""Live reproduction subset: `ppd-router serve --emulated LAYOUT` + `ppd-router bench`, real HTTP.

For each (layout, policy) a fresh router with an in-process emulated cluster is
started, each workload/QPS point is benched against it (open-loop Poisson, 10 s
of arrivals, 30 s timeout), and each bench --out JSON is appended to a JSON-lines
file with the run's metadata and wall time. Resumable: points already in the
output file are skipped.

    python bench/scripts/reproduce_live.py --out bench/results/reproduction/live.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

RUNS = [  # (layout, policy, label config in the paper's notation)
    ("1P3pD", "pd", "1P_3pD"), ("1P3pD", "local", "1P_3pD"), ("1P3pD", "ppd", "1P_3pD"),
    ("2P2pD", "pd", "2P_2pD"), ("2P2pD", "local", "2P_2pD"), ("2P2pD", "ppd", "2P_2pD"),
    ("3P1pD", "pd", "3P_1pD"), ("3P1pD", "local", "3P_1pD"), ("3P1pD", "ppd", "3P_1pD"),
    ("4R", "replica", "4R"),
]
TABLES = {"1P3pD": "tables/h100-llama3.1-8b-1P3pD.json", "2P2pD": "tables/h100-llama3.1-8b-2P2pD.json",
          "3P1pD": "tables/h100-llama3.1-8b-3P1pD.json"}


def wait_health(url: str, proc: subprocess.Popen, limit: float = 60.0) -> None:
    end = time.time() + limit
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError("router not healthy within 60 s")


@contextlib.contextmanager
def router(cmd: list[str], url: str) -> Iterator[subprocess.Popen]:
    """A `ppd-router serve` process, healthy on entry and stopped on exit, also on errors and Ctrl-C.

    Its stderr goes to a temporary file (a pipe nobody reads could fill and stall it) and is
    printed when the router does not come up.
    """
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        try:
            try:
                wait_health(url, server)
            except RuntimeError:
                log.seek(0)
                print(log.read().decode(errors="replace")[-2000:], file=sys.stderr)
                raise
            yield server
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def bench_point(url: str, workload: str, qps: float, duration: float,
                extra: Sequence[str] = ()) -> tuple[Optional[dict[str, Any]], float, str]:
    """One `ppd-router bench` point (30 s timeout, seed 0): its --out JSON (None when it failed),
    its wall time and its stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        t0 = time.time()
        bench = ["ppd-router", "bench", "--target", url, "--workload", workload,
                 "--qps", f"{qps:g}", "--duration", f"{duration:g}",
                 "--timeout", "30", "--seed", "0", "--json", "--out", str(out), *extra]
        p = subprocess.run(bench, capture_output=True, text=True)
        wall = time.time() - t0
        if p.returncode != 0:
            return None, wall, p.stderr.strip()
        return json.loads(out.read_text()), wall, p.stderr.strip()


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workloads", default="wildchat-like")
    ap.add_argument("--qps", default="2,8,16")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--only", default="", help="comma list of layout:policy to run (default all)")
    args = ap.parse_args()
    done = set()
    if args.out.exists():
        for line in args.out.read_text().splitlines():
            try:
                m = json.loads(line)["meta"]
                done.add((m["layout"], m["policy"], m["workload"], float(m["qps"])))
            except (ValueError, KeyError):
                continue
    only = {tuple(x.split(":")) for x in args.only.split(",") if x}
    url = f"http://127.0.0.1:{args.port}"
    t_all = time.time()
    for layout, policy, label in RUNS:
        if only and (layout, policy) not in only:
            continue
        todo = [(w, float(q)) for w in args.workloads.split(",") for q in args.qps.split(",")
                if (layout, policy, w, float(q)) not in done]
        if not todo:
            continue
        cmd = ["ppd-router", "serve", "--emulated", layout, "--policy", policy,
               "--port", str(args.port)]
        if policy == "ppd":
            cmd += ["--table", TABLES[layout], "--w-ttft", "1", "--w-tpot", "1"]
        with router(cmd, url):
            for wl, q in todo:
                r, wall, err = bench_point(url, wl, q, args.duration)
                if r is None:
                    print(f"{layout} {policy} {wl} qps={q:g}: bench failed: {err}", file=sys.stderr)
                    continue
                r["meta"] = {"deployment": label, "layout": layout, "policy": policy,
                             "workload": wl, "qps": q, "duration_s": args.duration,
                             "timeout_s": 30.0, "w_ttft": 1.0, "w_tpot": 1.0,
                             "backend": "live-emulated", "wall_s": round(wall, 1),
                             "table": TABLES.get(layout) if policy == "ppd" else None}
                with open(args.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
                t1, t2 = r["turn1"], r["turn2plus"]
                print(f"{layout} {policy} {wl} qps={q:g}: wall {wall:.0f} s, SR "
                      f"{100 * (r['success_rate'] or 0):.1f}%, T2 TTFT avg "
                      f"{t2['avg_ttft_ms'] or 0:.0f} ms, T2 TPOT {t2['avg_tpot_ms'] or 0:.2f} ms, "
                      f"T1 TTFT {t1['avg_ttft_ms'] or 0:.0f} ms, local {r['local_share']}",
                      flush=True)
    print(f"total wall {time.time() - t_all:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
