"""Overload benchmark (issue 15): the router in front of 1 P + 2 pD emulated nodes at 3x and 5x the
rate the cluster sustains, with admission control on and off.

1. Ramp: the bench harness at --ramp rates (conversations/s, --ramp-duration s each); the sustained
   rate R is the highest whose requests all succeed with Turn-2+ TTFT p99 under --sustained-p99-s.
2. Overload: --factors x R for --duration s each, once with the router's admission settings
   (--admission, as `serve` flags) and once with admission off (no per-node limit).

Reports per run: requests sent, succeeded, shed (429 / 503), client timeouts, admitted TTFT
p50/p99, the router's RSS before and after, and the load average.

    . .venv/bin/activate
    python bench/scripts/overload.py --out bench/results/hardening-overload.json

Every process started here is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from router_overhead import Procs, free_port, loadavg, wait_http  # noqa: E402 - sibling script's helpers

ADMISSION_OFF = ["--max-inflight-per-node", "0"]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bench(ppd: str, url: str, workload: str, qps: float, duration: float, timeout: float, out: Path) -> dict:
    cmd = [ppd, "bench", "--target", url, "--workload", workload, "--qps", str(qps), "--duration", str(duration),
           "--timeout", str(timeout), "--json", "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=duration + 4 * timeout)
    return json.loads(out.read_text())


def summary(run: dict) -> dict[str, Any]:
    o = run["overall"]
    fails = run["failures"]
    return {
        "sent": run["total_requests"],
        "succeeded": run["total_requests"] - run["failed_requests"],
        "shed_429": fails.get("http_429", 0),
        "shed_503": fails.get("http_503", 0),
        "client_timeouts": fails.get("timeout", 0),
        "other_failures": {k: v for k, v in fails.items() if k not in ("http_429", "http_503", "timeout")},
        "admitted_ttft_p50_ms": o.get("p50_ttft_ms"),
        "admitted_ttft_p99_ms": o.get("p99_ttft_ms"),
        "t2_ttft_p99_ms": run["turn2plus"].get("p99_ttft_ms"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--workload", default="large_very_long_gen", help="long decodes: capacity is decode-bound")
    ap.add_argument("--ramp", type=float, nargs="+", default=[0.5, 1, 2, 3, 4, 6, 8])
    ap.add_argument("--ramp-duration", type=float, default=15)
    ap.add_argument("--sustained-p99-s", type=float, default=2.0)
    ap.add_argument("--factors", type=float, nargs="+", default=[3, 5])
    ap.add_argument("--duration", type=float, default=30)
    ap.add_argument("--timeout", type=float, default=60, help="client timeout per request, s")
    ap.add_argument("--admission", default="--max-inflight-per-node 64 --queue-size 256 --queue-timeout 10",
                    help="the admission settings measured, as serve flags")
    ap.add_argument("--out")
    args = ap.parse_args()
    admission_on = args.admission.split()

    ppd = str(Path(sys.executable).parent / "ppd-router")
    tmp = Path(tempfile.mkdtemp(prefix="overload-"))
    procs = Procs(tmp)
    result: dict[str, Any] = {"meta": {"argv": sys.argv, "nproc": os.cpu_count(), "workload": args.workload,
                                       "start_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                                       "admission_on": admission_on, "admission_off": ADMISSION_OFF},
                              "ramp": [], "overload": []}
    try:
        nodes: dict[str, str] = {}
        for name, role in (("P", "P"), ("pD0", "pD"), ("pD1", "pD")):
            port = free_port()
            p = procs.start(name, [ppd, "emulate", "--role", role, "--port", str(port)])
            nodes[name] = f"http://127.0.0.1:{port}"
            wait_http(nodes[name] + "/health", 60, p)

        def router(extra: list[str]) -> tuple[str, int]:
            port = free_port()
            r = procs.start(f"router-{port}", [ppd, "serve", "--prefill", nodes["P"], "--pd-capable", nodes["pD0"],
                                               nodes["pD1"], "--port", str(port), *extra])
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/health", 30, r)
            return url, r.pid

        url, _ = router(ADMISSION_OFF)
        sustained = 0.0
        for q in args.ramp:
            run = bench(ppd, url, args.workload, q, args.ramp_duration, args.timeout, tmp / f"ramp-{q}.json")
            s = summary(run)
            s["qps"] = q
            result["ramp"].append(s)
            p99 = (s["t2_ttft_p99_ms"] or float("inf")) / 1000
            ok = s["succeeded"] == s["sent"] and p99 <= args.sustained_p99_s
            print(f"ramp {q:g} conv/s: {s}", flush=True)
            if not ok:
                break
            sustained = q
        if sustained == 0:
            raise SystemExit("no ramp rate was sustained")
        result["meta"]["sustained_qps"] = sustained
        for factor in args.factors:
            for label, flags in (("admission", admission_on), ("no_admission", ADMISSION_OFF)):
                url, pid = router(flags)
                before = rss_mib(pid)
                la0 = loadavg()
                run = bench(ppd, url, args.workload, factor * sustained, args.duration, args.timeout,
                            tmp / f"{label}-{factor}.json")
                time.sleep(2)
                s = summary(run)
                s.update({"factor": factor, "qps": factor * sustained, "router": label, "rss_mib_before": before,
                          "rss_mib_after": rss_mib(pid), "loadavg_before_after": [la0, loadavg()]})
                result["overload"].append(s)
                print(f"{factor:g}x ({factor * sustained:g} conv/s) {label}: {s}", flush=True)
    finally:
        procs.stop_all()
        result["meta"]["end_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
