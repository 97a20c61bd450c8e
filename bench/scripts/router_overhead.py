"""Added TTFT of ``ppd-router serve`` (and of PyPI ``vllm-router``) over calling emulator nodes directly.

Starts, as separate processes on 127.0.0.1: one P and one pD emulator node with the
zero-compute profile ``tables/engine-zero.toml``; ``ppd-router serve --policy local``
in front of them; and, when installed (``.venv-bench/bin/vllm-router``), ``vllm-router
--vllm-pd-disaggregation`` in front of the same two nodes. Then, for each repetition and
rate, it runs the open-loop load generator ``bench/loadgen`` (Rust, Poisson arrivals,
TTFT = request handed to the HTTP client -> first SSE body chunk) against each target:

  direct_t1     Turn-1 body straight to the pD node (streamed)
  client_pd_t1  Turn-1 body, the NIXL P -> D exchange done by the load generator itself
  ppd_pd_t1     Turn-1 body through ppd-router (path pd: P then D)
  vllm_pd_t1    Turn-1 body through vllm-router (PD mode: P then D)
  direct_t2     Turn-2 body (with history) straight to the pD node
  ppd_local_t2  Turn-2 body through ppd-router, sessions primed by a Turn 1 (path local)
  b_pd_t1, b_local_t2   the same through a second ppd-router build, with --router-b (an A/B of
                two builds in one run: e.g. the serve_toml example built from another commit)

and reports p50/p99 TTFT, the added TTFT of each routed target over its baseline (the
difference of the percentiles, median over repetitions), the CPU each process used, and
then ramps the offered rate per target to find the maximum sustained rate (success >= 99 %
and achieved >= 95 % of offered). Every load run is bounded by count (rate x duration),
per-request timeout and wall time; every process started here is stopped at the end.

    . .venv/bin/activate
    python bench/scripts/router_overhead.py --rates 500 2000 --duration 10 --reps 3 \
        --ramp 2000 3000 4000 5000 6000 8000 --out /tmp/overhead.json
    python bench/scripts/router_overhead.py --report /tmp/overhead.json     # tables again
    # before/after: the serve_toml example of another build next to this one, same nodes, same run
    python bench/scripts/router_overhead.py --router-b /tmp/base/target/release/examples/serve_toml \
        --targets direct_t2 ppd_local_t2 b_local_t2 --rates 500 --ramp
    python bench/scripts/router_overhead.py --python-probe 3 500 1000 2000  # can aiohttp drive it?
    # user-space instructions per request (valgrind callgrind), for each router build given
    python bench/scripts/router_overhead.py --instructions 470 target/release/examples/serve_toml [OTHER_BUILD...]

The load generator is built on first use (cargo, into target/loadgen; its crates are fetched
from crates.io the first time). vllm-router
comes from its own venv: python -m venv .venv-bench && .venv-bench/bin/pip install vllm-router.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOADGEN_DIR = ROOT / "bench" / "loadgen"
LOADGEN_TARGET = ROOT / "target" / "loadgen"
LOADGEN = LOADGEN_TARGET / "release" / "ppd-loadgen"
PROFILE = ROOT / "tables" / "engine-zero.toml"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
WARMUP = 200  # the loadgen's default --warmup: sequential requests before the measured arrivals

TARGETS = ["direct_t1", "client_pd_t1", "ppd_pd_t1", "vllm_pd_t1", "b_pd_t1", "direct_t2", "ppd_local_t2",
           "b_local_t2"]
ROUTER_OF = {"ppd_pd_t1": "ppd", "ppd_local_t2": "ppd", "vllm_pd_t1": "vllm", "b_pd_t1": "b", "b_local_t2": "b"}
# (routed target, baseline): the added TTFT reported.
PAIRS = [
    ("ppd_pd_t1", "direct_t1"),
    ("ppd_pd_t1", "client_pd_t1"),
    ("vllm_pd_t1", "direct_t1"),
    ("vllm_pd_t1", "client_pd_t1"),
    ("client_pd_t1", "direct_t1"),
    ("ppd_local_t2", "direct_t2"),
    ("b_pd_t1", "client_pd_t1"),
    ("b_local_t2", "direct_t2"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its live children (all threads), from /proc."""
    total = 0.0
    tck = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(k) for k in kids]
    except OSError:
        pass
    for p in pids:
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / tck
        except OSError:
            pass
    return total


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0]


def wait_http(url: str, deadline_s: float, proc: subprocess.Popen) -> None:
    end = time.time() + deadline_s
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[:3]} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {deadline_s} s")


class Procs:
    """Processes started here; all stopped (their process groups) on exit."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "wb")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5)


def build_info() -> dict:
    """Which ppd-router build is measured: HEAD, whether the Rust sources differ from it, the .so."""
    import hashlib

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    info = {"head": git("rev-parse", "--short", "HEAD"),
            "rust_sources_dirty": bool(git("status", "--porcelain", "rust")),
            "python": sys.executable}
    try:
        from ppd_router import _core

        so = Path(_core.__file__)
        info["core_so"] = str(so)
        info["core_so_mtime_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(so.stat().st_mtime))
        info["core_so_sha256_12"] = hashlib.sha256(so.read_bytes()).hexdigest()[:12]
    except Exception as e:  # noqa: BLE001 - informational only
        info["core_so"] = f"unknown: {e}"
    return info


def build_loadgen() -> None:
    if LOADGEN.exists():
        return
    env = dict(os.environ, CARGO_TARGET_DIR=str(LOADGEN_TARGET))
    subprocess.run(["cargo", "build", "--release", "-q"], cwd=LOADGEN_DIR, env=env, check=True)


def bodies(tmp: Path, max_tokens: int, d_url: str | None = None) -> tuple[Path, Path]:
    """Turn 1 and Turn 2 of one conversation, greedy. With `d_url`, Turn 2's history holds the
    answer that node gives Turn 1, as a client's would: ppd-router checks that a named session's
    history extends what it served (else the turn is pd/prefix_mismatch)."""
    user1 = "Tell me about the history of the city of Lyon in a few sentences, please."
    t1 = {"model": MODEL, "messages": [{"role": "user", "content": user1}],
          "max_tokens": max_tokens, "stream": True, "temperature": 0}
    answer = "Lyon was founded by the Romans as Lugdunum in 43 BC."
    if d_url:
        req = urllib.request.Request(f"{d_url}/v1/chat/completions", data=json.dumps({**t1, "stream": False}).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
    t2 = {"model": MODEL, "messages": [
        {"role": "user", "content": user1},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And what about its food?"}],
        "max_tokens": max_tokens, "stream": True, "temperature": 0}
    p1, p2 = tmp / "turn1.json", tmp / "turn2.json"
    p1.write_text(json.dumps(t1))
    p2.write_text(json.dumps(t2))
    return p1, p2


def start_nodes(procs: Procs, ppd: str, port: dict, url: dict) -> dict:
    """One P and one pD emulator node on the zero-compute profile; returns their pids by key."""
    pid = {}
    for role, key in (("P", "P"), ("pD", "D")):
        p = procs.start(f"emu-{key}", [ppd, "emulate", "--role", role, "--port", str(port[key]),
                                        "--profile", str(PROFILE)])
        wait_http(url[key] + "/health", 30, p)
        pid[key] = p.pid
    return pid


def start_vllm_router(procs: Procs, exe: str, url: dict, port: int) -> tuple[int, str]:
    """PyPI vllm-router in PD mode over the same P and D; returns its pid and package version."""
    v = procs.start("vllm-router", [exe, "--vllm-pd-disaggregation", "--prefill", url["P"],
                                    "--decode", url["D"], "--policy", "round_robin", "--host", "127.0.0.1",
                                    "--port", str(port)])
    wait_http(f"http://127.0.0.1:{port}/health", 60, v)
    version = subprocess.run([str(Path(exe).parent / "python"), "-c",
                              "import importlib.metadata as m; print(m.version('vllm-router'))"],
                             capture_output=True, text=True).stdout.strip()
    return v.pid, version


def start_router_b(procs: Procs, command: str, tmp: Path, url: dict, port: int) -> int:
    """A second router build, run as `COMMAND CONFIG.toml` (ppd-server's serve_toml example) with the
    settings ppd-router gets here (P and pD nodes, policy local); returns its pid once healthy."""
    cfg_b = tmp / "router-b.toml"
    cfg_b.write_text(f'port = {port}\nprefill = ["{url["P"]}"]\npd_capable = ["{url["D"]}"]\npolicy = "local"\n')
    b = procs.start("router-b", [*command.split(), str(cfg_b)])
    wait_http(f"http://127.0.0.1:{port}/health", 30, b)
    return b.pid


def loadgen_argv(target: str, target_url: str | None, url: dict, rate: float, duration: float, timeout: float,
                 seed: int, bodies: tuple[Path, Path], sessions: int, prime: bool, t1_prefix: str) -> list[str]:
    """The load generator's command for one target: `client_pd_t1` does the NIXL exchange itself,
    `*_t1` sends unique Turn-1 conversations, `*_t2` Turn 2 of `sessions` conversations (primed
    with a Turn 1 through the target when `prime`, so a router holds their sessions)."""
    argv = [str(LOADGEN), "--rate", str(rate), "--duration", str(duration), "--timeout", str(timeout),
            "--seed", str(seed)]
    if target == "client_pd_t1":
        argv += ["--client-pd", "--prefill", url["P"], "--decode", url["D"]]
    else:
        argv += ["--target", target_url or url["D"]]
    t1, t2 = bodies
    if target.endswith("t1"):
        argv += ["--body", str(t1), "--unique-sessions", "--session-prefix", t1_prefix]
    else:
        argv += ["--body", str(t2), "--sessions", str(sessions), "--session-prefix", f"s{seed}-"]
        if prime:
            argv += ["--prime-body", str(t1)]
    return argv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--rates", type=float, nargs="+", default=[500.0, 2000.0])
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ramp", type=float, nargs="*", default=[2000, 3000, 4000, 5000, 6000, 8000],
                    help="offered rates for the max-sustained search (empty: skip)")
    ap.add_argument("--ramp-duration", type=float, default=5.0)
    ap.add_argument("--ramp-targets", nargs="*", default=["direct_t1", "ppd_pd_t1", "vllm_pd_t1", "direct_t2", "ppd_local_t2"])
    ap.add_argument("--targets", nargs="*", default=TARGETS)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=256, help="Turn-2 sessions (primed once per run)")
    ap.add_argument("--timeout", type=float, default=5.0, help="per-request limit, s")
    ap.add_argument("--loadgen-threads", type=int, default=1)
    ap.add_argument("--vllm-router", default=str(ROOT / ".venv-bench" / "bin" / "vllm-router"))
    ap.add_argument("--router-b", help="a second router build, run as `ROUTER_B CONFIG.toml` (the serve_toml "
                    "example of ppd-server) with the same settings; measured as the b_* targets")
    ap.add_argument("--ppd-setting", action="append", default=[], metavar="KEY=TOML_VALUE",
                    help="extra setting for ppd-router serve (not router B), e.g. worker_threads=1")
    ap.add_argument("--out", help="write all raw summaries here (JSON)")
    args = ap.parse_args()

    build_loadgen()
    ppd = str(Path(sys.executable).parent / "ppd-router")
    have_vllm = Path(args.vllm_router).exists()
    targets = [t for t in args.targets if (have_vllm or not t.startswith("vllm"))
               and (args.router_b or not t.startswith("b_"))]
    tmp = Path(tempfile.mkdtemp(prefix="router-overhead-"))
    procs = Procs(tmp)
    port = {k: free_port() for k in ("P", "D", "ppd", "vllm", "b")}
    url = {k: f"http://127.0.0.1:{v}" for k, v in port.items()}
    results: dict = {"runs": [], "ramp": {}, "meta": {
        "rates": args.rates, "duration_s": args.duration, "reps": args.reps, "max_tokens": args.max_tokens,
        "nproc": os.cpu_count(), "start_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "vllm_router": have_vllm, "router_b": args.router_b, "ppd_settings": args.ppd_setting,
        "logs": str(tmp), "build": build_info()}}
    try:
        pid = start_nodes(procs, ppd, port, url)
        t1, t2 = bodies(tmp, args.max_tokens, url["D"])
        extra = tmp / "ppd-settings.toml"
        extra.write_text("".join(f"{kv.split('=', 1)[0].strip()} = {kv.split('=', 1)[1].strip()}\n"
                                 for kv in args.ppd_setting))
        r = procs.start("ppd-router", [ppd, "serve", "--config", str(extra), "--prefill", url["P"],
                                       "--pd-capable", url["D"], "--policy", "local", "--port", str(port["ppd"])])
        wait_http(url["ppd"] + "/health", 30, r)
        pid["ppd"] = r.pid
        if args.router_b:
            pid["b"] = start_router_b(procs, args.router_b, tmp, url, port["b"])
        if have_vllm:
            pid["vllm"], results["meta"]["vllm_router_version"] = start_vllm_router(
                procs, args.vllm_router, url, port["vllm"])

        def run(target: str, rate: float, duration: float, seed: int) -> dict:
            router = ROUTER_OF.get(target)
            argv = loadgen_argv(target, url[router] if router else None, url, rate, duration, args.timeout, seed,
                                (t1, t2), args.sessions, prime=router is not None, t1_prefix=f"{target}-")
            argv += ["--threads", str(args.loadgen_threads)]
            watched = {k: pid[k] for k in ("P", "D")} | ({router: pid[router]} if router else {})
            c0 = {k: cpu_seconds(p) for k, p in watched.items()}
            la0 = loadavg()
            out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + args.timeout + 120)
            if out.returncode != 0:
                raise SystemExit(f"loadgen failed ({out.returncode}): {out.stderr[-2000:]}")
            s = json.loads(out.stdout)
            s["cpu_s"] = {k: round(cpu_seconds(p) - c0[k], 3) for k, p in watched.items()}
            s["loadavg_before_after"] = [la0, loadavg()]
            s["target"], s["rate"], s["argv"] = target, rate, argv
            # Requests the processes served during this loadgen run (warm-up and priming included).
            s["served"] = s["sent"] + WARMUP + (args.sessions if "--prime-body" in argv else 0)
            if out.stderr.strip():
                s["stderr"] = out.stderr.strip()[-500:]
            for k in pid:
                # A node or router that died invalidates the run.
                if procs.procs and any(p.pid == pid[k] and p.poll() is not None for p in procs.procs):
                    raise SystemExit(f"{k} exited during the run; logs in {tmp}")
            return s

        def line(s: dict) -> str:
            t = {k: (float("nan") if v is None else v) for k, v in s["ttft_us"].items()}
            return (f"{s['target']:>13} @ {s['rate']:>6g}/s: ok {s['ok']}/{s['arrivals']} "
                    f"achieved {s['achieved_rate']:.0f}/s TTFT p50 {t['p50']:.0f} p99 {t['p99']:.0f} us "
                    f"paths {s['paths']} errors {s['errors']} cpu {s['cpu_s']} "
                    f"loadgen {s['client_cpu_share_of_one_core']:.2f} core, load {s['loadavg_before_after']}")

        for rep in range(args.reps):
            for rate in args.rates:
                # Rotate the order so that slow drifts of the machine do not favour one target.
                order = targets[rep % len(targets):] + targets[:rep % len(targets)]
                for i, target in enumerate(order):
                    s = run(target, rate, args.duration, seed=1000 * rep + 10 * i + int(rate))
                    s["rep"] = rep
                    results["runs"].append(s)
                    print(line(s), flush=True)
        for target in [t for t in args.ramp_targets if t in targets and args.ramp]:
            steps = []
            for rate in args.ramp:
                s = run(target, rate, args.ramp_duration, seed=77 + int(rate))
                s["sustained"] = s["success"] >= 0.99 and s["achieved_rate"] >= 0.95 * rate
                steps.append(s)
                print("ramp " + line(s) + f" sustained={s['sustained']}", flush=True)
                if not s["sustained"]:
                    break
            ok = [s["rate"] for s in steps if s["sustained"]]
            results["ramp"][target] = {"max_sustained": max(ok) if ok else None,
                                       "first_failing": None if steps[-1]["sustained"] else steps[-1]["rate"],
                                       "steps": steps}
    finally:
        procs.stop_all()
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
    results["meta"]["end_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    report(results, targets)


def report(results: dict, targets: list[str]) -> None:
    runs = results["runs"]
    rates = results["meta"]["rates"]

    def get(target: str, rate: float) -> list[dict]:
        return [s for s in runs if s["target"] == target and s["rate"] == rate]

    def med(xs: list) -> float:
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else float("nan")

    print("\n### TTFT per target (median over repetitions; µs)\n")
    print("| target | rate/s | ok / arrivals (all reps) | TTFT p50 | TTFT p99 | achieved/s | paths | "
          "router CPU µs/req | P+D CPU µs/req | loadgen CPU (share of a core) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rate in rates:
        for t in targets:
            ss = get(t, rate)
            if not ss:
                continue
            ok, arr = sum(s["ok"] for s in ss), sum(s["arrivals"] for s in ss)
            router = next((k for k in ("ppd", "vllm", "b") if k in ss[0]["cpu_s"]), None)
            rcpu = med([s["cpu_s"][router] / max(s["served"], 1) * 1e6 for s in ss]) if router else None
            ncpu = med([(s["cpu_s"]["P"] + s["cpu_s"]["D"]) / max(s["served"], 1) * 1e6 for s in ss])
            paths = {}
            for s in ss:
                for k, v in s["paths"].items():
                    paths[k] = paths.get(k, 0) + v
            print(f"| {t} | {rate:g} | {ok} / {arr} | {med([s['ttft_us']['p50'] for s in ss]):.0f} | "
                  f"{med([s['ttft_us']['p99'] for s in ss]):.0f} | {med([s['achieved_rate'] for s in ss]):.0f} | "
                  f"{paths or '-'} | {'-' if rcpu is None else f'{rcpu:.0f}'} | {ncpu:.0f} | "
                  f"{med([s['client_cpu_share_of_one_core'] for s in ss]):.2f} |")

    print("\n### Added TTFT (target − baseline, per repetition, then the median; µs)\n")
    print("| target − baseline | rate/s | added p50 (each rep) | added p50 | added p99 (each rep) | added p99 |")
    print("|---|---|---|---|---|---|")
    added: dict = {}
    for a, b in PAIRS:
        if a not in targets or b not in targets:
            continue
        for rate in rates:
            A = {s["rep"]: s for s in get(a, rate)}
            B = {s["rep"]: s for s in get(b, rate)}
            reps = sorted(set(A) & set(B))
            d50 = [A[r]["ttft_us"]["p50"] - B[r]["ttft_us"]["p50"] for r in reps]
            d99 = [A[r]["ttft_us"]["p99"] - B[r]["ttft_us"]["p99"] for r in reps]
            added[(a, b, rate)] = (med(d50), med(d99))
            print(f"| {a} − {b} | {rate:g} | {', '.join(f'{x:.0f}' for x in d50)} | {med(d50):.0f} | "
                  f"{', '.join(f'{x:.0f}' for x in d99)} | {med(d99):.0f} |")

    if "vllm_pd_t1" in targets:
        print("\n### ppd-router pd path vs vllm-router PD mode (ratios ppd / vllm; < 1 = ppd-router better)\n")
        print("| rate/s | TTFT p50 ratio | TTFT p99 ratio | added p50 vs client-pd: ppd / vllm | "
              "added p99 vs client-pd: ppd / vllm | router CPU µs/req: ppd / vllm |")
        print("|---|---|---|---|---|---|")
        for rate in rates:
            P, V = get("ppd_pd_t1", rate), get("vllm_pd_t1", rate)
            if not P or not V:
                continue
            r50 = med([s["ttft_us"]["p50"] for s in P]) / med([s["ttft_us"]["p50"] for s in V])
            r99 = med([s["ttft_us"]["p99"] for s in P]) / med([s["ttft_us"]["p99"] for s in V])
            pa = added.get(("ppd_pd_t1", "client_pd_t1", rate), (float("nan"),) * 2)
            va = added.get(("vllm_pd_t1", "client_pd_t1", rate), (float("nan"),) * 2)
            pc = med([s["cpu_s"]["ppd"] / max(s["served"], 1) * 1e6 for s in P])
            vc = med([s["cpu_s"]["vllm"] / max(s["served"], 1) * 1e6 for s in V])
            print(f"| {rate:g} | {r50:.2f} | {r99:.2f} | {pa[0]:.0f} / {va[0]:.0f} | {pa[1]:.0f} / {va[1]:.0f} | "
                  f"{pc:.0f} / {vc:.0f} |")

    if any(t.startswith("b_") for t in targets):
        print("\n### This ppd-router vs router B, same nodes, same run (ratios this / B; < 1 = this better)\n")
        print("| path | rate/s | TTFT p50 | TTFT p99 | added p50: this / B | added p99: this / B | "
              "router CPU µs/req: this / B |")
        print("|---|---|---|---|---|---|---|")
        for a, b, base in (("ppd_local_t2", "b_local_t2", "direct_t2"), ("ppd_pd_t1", "b_pd_t1", "client_pd_t1")):
            for rate in rates:
                A, B = get(a, rate), get(b, rate)
                if not A or not B:
                    continue
                r50 = med([s["ttft_us"]["p50"] for s in A]) / med([s["ttft_us"]["p50"] for s in B])
                r99 = med([s["ttft_us"]["p99"] for s in A]) / med([s["ttft_us"]["p99"] for s in B])
                aa = added.get((a, base, rate), (float("nan"),) * 2)
                ba = added.get((b, base, rate), (float("nan"),) * 2)
                ac = med([s["cpu_s"]["ppd"] / max(s["served"], 1) * 1e6 for s in A])
                bc = med([s["cpu_s"]["b"] / max(s["served"], 1) * 1e6 for s in B])
                print(f"| {a.split('_')[1]} | {rate:g} | {r50:.2f} | {r99:.2f} | {aa[0]:.0f} / {ba[0]:.0f} | "
                      f"{aa[1]:.0f} / {ba[1]:.0f} | {ac:.0f} / {bc:.0f} ({ac / bc:.2f}) |")

    if results["ramp"]:
        print("\n### Maximum sustained rate (success ≥ 99 % and achieved ≥ 95 % of offered; one ramp)\n")
        print("| target | max sustained req/s | first failing step | at the failing step |")
        print("|---|---|---|---|")
        for t, r in results["ramp"].items():
            last = r["steps"][-1]
            note = (f"ok {last['success'] * 100:.1f} %, achieved {last['achieved_rate']:.0f}/s, "
                    f"TTFT p50 {last['ttft_us']['p50']:.0f} µs, errors {last['errors']}") if r["first_failing"] else "-"
            print(f"| {t} | {r['max_sustained'] if r['max_sustained'] is not None else 'none'} | "
                  f"{r['first_failing'] if r['first_failing'] is not None else '(none; ramp ended)'} | {note} |")


async def _aiohttp_open_loop(url: str, body: bytes, rate: float, duration: float, timeout: float) -> dict:
    """The Python alternative to bench/loadgen: aiohttp, Poisson arrivals from the event loop."""
    import asyncio
    import random

    import aiohttp

    rng = random.Random(1)
    ttft: list[float] = []
    errors = 0
    conn = aiohttp.TCPConnector(limit=0)
    tasks = []
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        async def one() -> None:
            nonlocal errors
            t0 = time.perf_counter()
            try:
                async with http.post(url, data=body, headers={"content-type": "application/json"}) as r:
                    first = None
                    async for chunk in r.content.iter_any():
                        if first is None and chunk:
                            first = time.perf_counter()
                    if r.status == 200 and first is not None:
                        ttft.append((first - t0) * 1e6)
                    else:
                        errors += 1
            except Exception:
                errors += 1

        loop = asyncio.get_running_loop()
        start = loop.time()
        t = 0.0
        n = 0
        while n < int(rate * duration):
            t += rng.expovariate(rate)
            if t > duration:
                break
            delay = start + t - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
            n += 1
        end_dispatch = loop.time() - start
        await asyncio.wait(tasks, timeout=timeout + 2)
        span = loop.time() - start
    ttft.sort()
    return {"rate": rate, "arrivals": n, "ok": len(ttft), "errors": errors,
            "dispatch_s": round(end_dispatch, 2), "achieved_rate": len(ttft) / span,
            "ttft_p50_us": ttft[len(ttft) // 2] if ttft else None,
            "ttft_p99_us": ttft[int(len(ttft) * 0.99)] if ttft else None}


def python_probe(rates: list[float], duration: float) -> None:
    """Can a Python (aiohttp) client drive these rates here? One pD node, this process as client."""
    import asyncio
    import resource

    tmp = Path(tempfile.mkdtemp(prefix="router-overhead-probe-"))
    t1, _ = bodies(tmp, 8)
    procs = Procs(tmp)
    port = free_port()
    try:
        node = procs.start("emu-D", [str(Path(sys.executable).parent / "ppd-router"), "emulate", "--role", "pD",
                                     "--port", str(port), "--profile", str(PROFILE)])
        wait_http(f"http://127.0.0.1:{port}/health", 30, node)
        print("| client | offered/s | ok / arrivals | achieved/s | TTFT p50 / p99 µs | client CPU (share of a core) "
              "| node CPU (share of a core) |")
        print("|---|---|---|---|---|---|---|")
        for rate in rates:
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            n0 = cpu_seconds(node.pid)
            w0 = time.time()
            s = asyncio.run(_aiohttp_open_loop(f"http://127.0.0.1:{port}/v1/chat/completions",
                                               t1.read_bytes(), rate, duration, 5.0))
            wall = time.time() - w0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
            p50 = "-" if s["ttft_p50_us"] is None else f"{s['ttft_p50_us']:.0f}"
            p99 = "-" if s["ttft_p99_us"] is None else f"{s['ttft_p99_us']:.0f}"
            print(f"| python aiohttp | {rate:g} | {s['ok']} / {s['arrivals']} | {s['achieved_rate']:.0f} | "
                  f"{p50} / {p99} | {cpu / wall:.2f} | {(cpu_seconds(node.pid) - n0) / wall:.2f} |", flush=True)
    finally:
        procs.stop_all()


def instructions(n: int, builds: list[str], max_tokens: int = 8) -> None:
    """User-space instructions per request of each router build (`BUILD CONFIG.toml`, e.g. the
    serve_toml example), under valgrind's callgrind: warm up, zero the counters, send ~n streamed
    Turn-2 requests of `max_tokens` tokens on the local path at 50/s, dump, divide. Machine load
    does not change it; two runs with different `max_tokens` give the cost of a relayed token."""
    build_loadgen()
    tmp = Path(tempfile.mkdtemp(prefix="router-instructions-"))
    procs = Procs(tmp)
    port = {k: free_port() for k in ("P", "D", "r")}
    url = {k: f"http://127.0.0.1:{v}" for k, v in port.items()}
    ppd = str(Path(sys.executable).parent / "ppd-router")
    print("| build | requests | instructions | instructions per request |")
    print("|---|---|---|---|")
    try:
        for role, key in (("P", "P"), ("pD", "D")):
            p = procs.start(f"emu-{key}", [ppd, "emulate", "--role", role, "--port", str(port[key]),
                                            "--profile", str(PROFILE)])
            wait_http(url[key] + "/health", 30, p)
        t1, t2 = bodies(tmp, max_tokens, url["D"])
        for i, build in enumerate(builds):
            cfg = tmp / f"router-{i}.toml"
            cfg.write_text(f'port = {port["r"]}\nprefill = ["{url["P"]}"]\npd_capable = ["{url["D"]}"]\n'
                           'policy = "local"\n')
            out = tmp / f"callgrind-{i}.out"
            r = procs.start(f"router-{i}", ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                                            *build.split(), str(cfg)])
            wait_http(url["r"] + "/health", 120, r)
            base = [str(LOADGEN), "--target", url["r"], "--body", str(t2), "--sessions", "64",
                    "--session-prefix", f"i{i}-", "--timeout", "20", "--rate", "50"]
            subprocess.run(base + ["--duration", "2", "--prime-body", str(t1), "--warmup", "20"],
                           check=True, capture_output=True)
            subprocess.run(["callgrind_control", "-z", str(r.pid)], check=True, capture_output=True)
            m = json.loads(subprocess.run(base + ["--duration", str(n / 50), "--warmup", "0"], check=True,
                                          capture_output=True, text=True).stdout)
            subprocess.run(["callgrind_control", "-d", str(r.pid)], check=True, capture_output=True)
            os.killpg(r.pid, signal.SIGTERM)
            r.wait(30)
            dump = Path(f"{out}.1")
            total = next(int(x.split()[1]) for x in dump.read_text().splitlines() if x.startswith("summary:"))
            if m["ok"] != m["sent"] or m["paths"] != {"local": m["ok"]}:
                raise SystemExit(f"{build}: not every request succeeded on the local path: {m['paths']}")
            print(f"| {build} | {m['ok']} | {total} | {total / m['ok']:.0f} |", flush=True)
    finally:
        procs.stop_all()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--python-probe":
        # python router_overhead.py --python-probe DURATION RATE...
        python_probe([float(x) for x in sys.argv[3:]], float(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--instructions":
        # python router_overhead.py --instructions N [--max-tokens K] BUILD...
        if sys.argv[3] == "--max-tokens":
            instructions(int(sys.argv[2]), sys.argv[5:], int(sys.argv[4]))
        else:
            instructions(int(sys.argv[2]), sys.argv[3:])
    elif len(sys.argv) > 1 and sys.argv[1] == "--report":
        # Re-print the tables from a saved --out file.
        data = json.loads(Path(sys.argv[2]).read_text())
        report(data, [t for t in TARGETS if any(s["target"] == t for s in data["runs"])])
    else:
        main()
