"""build-table --backend live: a resumable Phase-1 build against two stub endpoints."""

from __future__ import annotations

import contextlib
import io

import orjson
import pytest
from ppd_router import DecisionEngine, Table
from ppd_router.bench.arrivals import poisson_arrivals
from ppd_router.bench.build_table import cell_measurement, load_log, table_doc
from ppd_router.bench.stub_server import StubConfig, StubServer, user_turn
from ppd_router.cli import main

X0_TTFT, X1_TTFT = 0.06, 0.005
QPS, DURATION, SEED = [4.0, 6.0], 0.4, 4


@pytest.fixture(scope="module")
def endpoints():
    x0 = StubConfig(ttft_s=X0_TTFT, itl_s=0.0, record=True)
    x1 = StubConfig(ttft_s=X1_TTFT, itl_s=0.0, record=True)
    with StubServer(x0) as s0, StubServer(x1) as s1:
        yield s0, s1


def _build(s0, s1, out, qps, extra=()):
    argv = ["build-table", "--x0", s0.url, "--x1", s1.url, "--out", str(out),
            "--contexts", "small", "--workloads", "tiny,mid_bal",
            "--qps", ",".join(f"{q:g}" for q in qps), "--duration", str(DURATION),
            "--seed", str(SEED), "--deployment", "stub", *extra]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, err.getvalue()


def _turn2_requests(stub: StubServer) -> int:
    return sum(1 for s in stub.cfg.seen if user_turn(s.body) == 2)


def test_build_writes_a_valid_table_and_resumes(endpoints, tmp_path):
    s0, s1 = endpoints
    out = tmp_path / "t.json"
    assert all(poisson_arrivals(q, DURATION, SEED) for q in QPS)  # every run has conversations
    rc, _ = _build(s0, s1, out, QPS[:1])
    assert rc == 0
    first = Table.load(out)
    assert len(first) == 2  # tiny and mid_bal at the first QPS level

    before = (_turn2_requests(s0), _turn2_requests(s1))
    rc, err = _build(s0, s1, out, QPS)
    assert rc == 0 and "4 runs to do, 4 already" in err
    table = Table.load(out)
    assert len(table) == 4 and table.deployment == "stub"
    # Only the new QPS level ran: as many Turn-2 requests per path as its arrivals.
    n_new = len(poisson_arrivals(QPS[1], DURATION, SEED))
    assert (_turn2_requests(s0) - before[0], _turn2_requests(s1) - before[1]) == \
        (2 * n_new, 2 * n_new)

    doc = orjson.loads(out.read_bytes())
    for cell in doc["cells"]:
        n = len(poisson_arrivals(cell["qps"], DURATION, SEED))
        assert cell["x0"]["n"] == cell["x1"]["n"] == n  # every Turn 2 succeeded
        assert cell["x0"]["ttft_ms"] >= 0.9 * X0_TTFT * 1000
    # The engine reads it: Turn 1 always goes pd.
    assert DecisionEngine(table, "ppd", 1.0, 1.0).decide(1, 128, 128, 0, 4.0).path == "pd"


def test_unreachable_endpoint_exits_2(tmp_path):
    rc, err = _build(type("S", (), {"url": "http://127.0.0.1:9"})(),
                     type("S", (), {"url": "http://127.0.0.1:9"})(), tmp_path / "t.json", [1.0])
    assert rc == 2 and "cannot reach" in err


def test_bad_target_and_bad_lists_exit_2(tmp_path, capsys):
    rc, err = _build(type("S", (), {"url": "ftp://x"})(), type("S", (), {"url": "ftp://x"})(),
                     tmp_path / "t.json", [1.0])
    assert rc == 2 and "http(s) URL" in err
    with pytest.raises(SystemExit) as e:
        main(["build-table", "--x0", "http://a", "--x1", "http://b", "--out", "t.json",
              "--workloads", "tiny,bogus"])
    assert e.value.code == 2 and "unknown bogus" in capsys.readouterr().err


def test_log_ignores_a_torn_last_line_and_keeps_failed_runs(tmp_path):
    log = tmp_path / "t.json.runs.jsonl"
    ok = {"context": "small", "workload": "tiny", "qps": 1, "x": 0,
          "measurement": {"ttft_ms": 10.0, "tpot_ms": 1.0, "n": 3}}
    failed = {"context": "small", "workload": "tiny", "qps": 1, "x": 1, "measurement": None}
    log.write_bytes(orjson.dumps(ok) + b"\n" + orjson.dumps(failed) + b"\n{\"context\": \"sm")
    done = load_log(log)
    assert done == {("small", "tiny", 1.0, 0): ok["measurement"], ("small", "tiny", 1.0, 1): None}
    doc, skipped = table_doc(done, ["tiny"], [1.0], {})
    assert doc["cells"] == [] and skipped == ["small/tiny/qps=1"]


def test_cell_measurement_needs_turn2_successes():
    empty = {"turn2plus": {"count": 0, "avg_ttft_ms": None, "avg_tpot_ms": None}}
    assert cell_measurement(empty) is None
    full = {"turn2plus": {"count": 5, "avg_ttft_ms": 12.5, "avg_tpot_ms": 2.0}}
    assert cell_measurement(full) == {"ttft_ms": 12.5, "tpot_ms": 2.0, "n": 5}
