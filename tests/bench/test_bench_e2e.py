"""End-to-end bench runs against a stub OpenAI-compatible streaming server on 127.0.0.1.

The stub fails chosen requests in each way the client must classify and sets
``x-ppd-path`` per request; the tests derive every expected count from the
same seeded arrival schedule and rules, never from a recorded run.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
from collections import Counter
from typing import Any

import pytest
from ppd_router.bench.arrivals import poisson_arrivals
from ppd_router.bench.metrics import NOT_SENT, SWEEP_COLUMNS
from ppd_router.bench.stub_server import StubConfig, StubServer, user_turn
from ppd_router.cli import main

QPS, DURATION, SEED, TURNS = 8.0, 1.5, 11, 3
TTFT_S = 0.02
CLIENT_TIMEOUT = 0.6

# conversation index % 10 -> (turn, behaviour): one of each failure kind.
FAULTS = {1: (2, "http_500"), 3: (1, "hang"), 5: (2, "malformed"), 7: (3, "drop"),
          9: (2, "no_done")}
REASON = {"http_500": "http_500", "hang": "timeout", "malformed": "malformed_stream",
          "drop": "connection_error", "no_done": "malformed_stream"}


def _index(request: Any) -> int:
    return int(request.headers["X-Session-ID"].rsplit("-", 1)[1])


def behaviour(body: dict, request: Any) -> str:
    turn, what = FAULTS.get(_index(request) % 10, (0, "ok"))
    return what if user_turn(body) == turn else "ok"


def path_rule(body: dict, request: Any) -> str:
    if user_turn(body) == 1:
        return "pd"
    return "pd" if _index(request) % 3 == 0 else "local"


def expected() -> tuple[Counter, int, int, int]:
    """Failures by reason, successes, and Turn 2+ (sent, local) implied by the rules."""
    n = len(poisson_arrivals(QPS, DURATION, SEED))
    fails: Counter = Counter()
    ok = sent2 = local2 = 0
    for i in range(n):
        fault = FAULTS.get(i % 10)
        for turn in range(1, TURNS + 1):
            if fault and turn > fault[0]:
                fails[NOT_SENT] += 1
                continue
            if turn >= 2:
                sent2 += 1
                local2 += i % 3 != 0
            if fault and turn == fault[0]:
                fails[REASON[fault[1]]] += 1
            else:
                ok += 1
    return fails, ok, sent2, local2


@pytest.fixture(scope="module")
def stub():
    cfg = StubConfig(ttft_s=TTFT_S, itl_s=0.0, behaviour=behaviour, path_rule=path_rule,
                     record=True)
    with StubServer(cfg) as server:
        yield server


@pytest.fixture(scope="module")
def run(stub, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("bench")
    out, csv_path = out_dir / "out.json", out_dir / "sweep.csv"
    argv = ["bench", "--target", stub.url, "--workload", "small_mid_bal", "--turns", str(TURNS),
            "--qps", str(QPS), "--duration", str(DURATION), "--seed", str(SEED),
            "--timeout", str(CLIENT_TIMEOUT), "--out", str(out), "--csv", str(csv_path),
            "--config", "stub", "--json"]
    return argv, out, csv_path


@pytest.fixture(scope="module")
def result(run, stub):
    argv, out, csv_path = run
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(argv)
    return rc, json.loads(printed.getvalue()), out, csv_path, list(stub.cfg.seen)


def test_run_succeeds_and_prints_the_same_object_it_writes(result):
    rc, summary, out, _, _ = result
    assert rc == 0
    assert json.loads(out.read_text()) == summary
    for key in ("turn1", "turn2plus", "throughput", "success_rate", "local_share"):
        assert key in summary


def test_failures_are_classified_by_reason(result):
    _, summary, _, _, _ = result
    fails, ok, _, _ = expected()
    assert summary["failures"] == dict(sorted(fails.items()))
    n = len(poisson_arrivals(QPS, DURATION, SEED))
    assert summary["total_requests"] == n * TURNS
    assert summary["overall"]["count"] == ok
    assert summary["success_rate"] == pytest.approx(ok / (n * TURNS))


def test_local_share_is_read_from_the_header(result):
    _, summary, _, _, seen = result
    _, _, sent2, local2 = expected()
    assert summary["paths"] == {"local": local2, "pd": sent2 - local2}
    assert summary["local_share"] == pytest.approx(local2 / sent2)
    assert sum(1 for s in seen if user_turn(s.body) >= 2) == sent2


def test_measured_tokens_and_latencies_are_consistent(result):
    _, summary, _, _, _ = result
    t1, t2 = summary["turn1"], summary["turn2plus"]
    # small_mid_bal: Turn 1 answers 128 tokens, later turns 128 (ignore_eos, exact).
    assert t1["completion_tokens"] == 128 * t1["count"]
    assert t2["completion_tokens"] == 128 * t2["count"]
    for s in (t1, t2):
        assert s["p50_ttft_ms"] >= 0.9 * TTFT_S * 1000  # the stub waits before the first token
        assert s["avg_ttft_ms"] <= s["avg_e2e_ms"]
        assert s["p50_ttft_ms"] <= s["p90_ttft_ms"] <= s["p99_ttft_ms"]
        assert s["avg_tpot_ms"] > 0 and s["p99_e2e_ms"] <= CLIENT_TIMEOUT * 1000
    th = summary["throughput"]
    assert th["tokens_per_sec"] == pytest.approx(th["requests_per_sec"] * 128)


def test_requests_carry_streaming_options_and_the_streamed_history(result):
    _, _, _, _, seen = result
    by_conv: dict[str, list] = {}
    for s in seen:
        assert s.body["stream"] is True and s.body["stream_options"] == {"include_usage": True}
        assert s.body["ignore_eos"] is True and s.body["max_tokens"] == 128
        by_conv.setdefault(s.headers["X-Session-ID"], []).append(s.body["messages"])
    checked = 0
    for turns in by_conv.values():
        turns.sort(key=len)
        for prev, cur in zip(turns, turns[1:], strict=False):
            # Next turn = previous messages + the answer streamed back + a new user message.
            assert cur[: len(prev)] == prev
            assert cur[len(prev)] == {"role": "assistant", "content": " tok" * 128}
            assert cur[len(prev) + 1]["role"] == "user" and len(cur) == len(prev) + 2
            checked += 1
    assert checked > 0


def test_csv_row_has_sweep_columns_and_the_run(result):
    _, summary, _, csv_path, _ = result
    with open(csv_path, newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == SWEEP_COLUMNS and len(rows) == 2
    row = dict(zip(rows[0], rows[1], strict=True))
    assert (row["config"], row["t1_context"], row["t2_workload"]) == ("stub", "small", "mid_bal")
    assert int(row["total_requests"]) == summary["total_requests"]
    assert float(row["success_rate_pct"]) == pytest.approx(100 * summary["success_rate"])
    assert "timeout:" in row["error"] and "not_sent:" in row["error"]


def test_second_run_appends_a_row_to_the_csv(result, run, capsys):
    argv, _, csv_path = run
    short = argv[: argv.index("--out")] + argv[argv.index("--out") + 2:]
    short[short.index("--duration") + 1] = "0.3"
    assert main(short) == 0
    capsys.readouterr()
    with open(csv_path, newline="") as f:
        assert len(list(csv.reader(f))) == 3


def _run_quiet(argv: list[str]) -> tuple[int, dict, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, json.loads(out.getvalue()), err.getvalue()


def test_json_mode_prints_only_the_object(result, run):
    argv, _, _ = run
    short = argv[: argv.index("--out")] + ["--duration", "0.3", "--json"]
    rc, summary, err = _run_quiet(short)
    assert rc == 0 and err == "" and "turn1" in summary


def test_slo_objectives_add_the_attainment_the_simulator_counts(result, run):
    argv, _, _ = run
    short = argv[: argv.index("--out")] + ["--duration", "0.3", "--json"]
    rc, s, _ = _run_quiet(short + ["--slo-ttft-ms", "1e9", "--slo-tpot-ms", "1e9"])
    assert rc == 0 and s["meta"]["slo"] == {"ttft_ms": 1e9, "tpot_ms": 1e9}
    sent = s["total_requests"] - s["failures"].get("not_sent", 0)
    assert s["slo_attainment"] == pytest.approx(s["overall"]["count"] / sent)  # every success meets them
    rc, s, _ = _run_quiet(short + ["--slo-ttft-ms", str(TTFT_S * 1000 / 2), "--slo-tpot-ms", "1e9"])
    assert rc == 0 and s["slo_attainment"] == 0.0 and s["slo_attainment_t2"] == 0.0


def test_events_whose_data_spans_several_lines_are_read_whole():
    # SSE joins an event's data: lines with newlines; a line-by-line reader saw broken JSON here.
    cfg = StubConfig(ttft_s=0.0, behaviour=lambda body, req: "multiline")
    with StubServer(cfg) as server:
        from ppd_router.bench.client import BenchConfig
        from ppd_router.bench.client import run as run_bench
        from ppd_router.bench.workloads import load_workload

        res = run_bench(BenchConfig(target=server.url, workload=load_workload("small_tiny"), qps=5, duration=0.6, seed=2))
    assert res.records and [r.reason for r in res.records if not r.ok] == []
    assert all(r.usage_reported for r in res.records)  # the usage event, split too, was parsed


def test_think_time_separates_turns_and_missing_usage_falls_back_to_word_rule():
    think = 0.15
    cfg = StubConfig(ttft_s=0.0, behaviour=lambda body, req: "no_usage", record=True)
    with StubServer(cfg) as server:
        from ppd_router.bench.client import BenchConfig
        from ppd_router.bench.client import run as run_bench
        from ppd_router.bench.workloads import load_workload

        res = run_bench(BenchConfig(target=server.url, workload=load_workload("small_tiny"),
                                    qps=5, duration=0.6, seed=2, think_time=think))
    recs = res.records
    assert recs and all(r.ok for r in recs)
    # No usage chunk: completion tokens come from the streamed text (" tok" = 1 token each).
    assert all(not r.usage_reported for r in recs)
    assert sorted({r.completion_tokens for r in recs}) == [32, 128]
    by_conv: dict[int, dict[int, Any]] = {}
    for r in recs:
        by_conv.setdefault(r.conversation, {})[r.turn] = r
    for turns in by_conv.values():
        first, second = turns[1], turns[2]
        assert second.start >= first.start + first.e2e + 0.9 * think


def test_out_file_carries_meta_that_the_report_reads(result):
    from ppd_router.report import load_rows

    _, summary, out, _, _ = result
    meta = summary["meta"]
    assert (meta["deployment"], meta["workload"], meta["qps"]) == ("stub", "small_mid_bal", QPS)
    (row,) = load_rows(out)
    assert (row.workload, row.qps) == ("small_mid_bal", QPS)
    assert row.t2_avg_ttft == summary["turn2plus"]["avg_ttft_ms"]
    assert row.success_rate == summary["success_rate"]


def test_refused_and_unanswered_connections_are_connection_errors_not_timeouts():
    # httpx-aiohttp reports aiohttp's connection errors as httpx ConnectTimeout; the client must
    # not count them as timeouts.
    import socket
    import threading

    from ppd_router.bench.client import BenchConfig
    from ppd_router.bench.client import run as run_bench
    from ppd_router.bench.workloads import load_workload

    def reasons(port: int) -> set:
        cfg = BenchConfig(target=f"http://127.0.0.1:{port}", workload=load_workload("small_tiny"), qps=20,
                          duration=0.5, model="m")
        return {r.reason for r in run_bench(cfg).records if r.reason != NOT_SENT}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused_port = s.getsockname()[1]  # closed again: nothing listens there
    assert reasons(refused_port) == {"connection_error"}

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)

    def read_then_close() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # the test closed the listener
            conn.recv(65536)
            conn.close()

    threading.Thread(target=read_then_close, daemon=True).start()
    try:
        assert reasons(server.getsockname()[1]) == {"connection_error"}
    finally:
        server.close()


def test_the_deployment_defaults_to_the_node_counts_a_router_reports(stub):
    import json

    from ppd_router import Router
    from ppd_router.bench.command import deployment_of
    from tests.helpers import free_port

    router = Router(json.dumps({"emulated": "1P2pD", "port": free_port()}))
    url = router.start()
    try:
        assert deployment_of(url) == "1P_2pD"
    finally:
        router.stop()
    # A target that does not list its nodes (a stand-in, or plain vLLM) leaves it to --config.
    assert deployment_of(stub.url) is None
