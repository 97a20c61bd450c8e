"""The ``ppd-router table`` commands."""

from __future__ import annotations

import json
import subprocess
import sys

from ppd_router.cli import main

from ..conftest import TABLES

TABLE = str(TABLES / "h100-llama3.1-8b-2P2pD.json")


def test_decide_prints_one_json_route(capsys):
    rc = main(["table", "decide", TABLE, "--turn", "2", "--n-in", "512", "--n-out", "64", "--ctx", "2000", "--qps", "20"])
    assert rc == 0
    route = json.loads(capsys.readouterr().out)
    assert set(route) >= {"path", "reason", "score", "cell"}
    assert route["path"] == "pd" and route["reason"] == "score_negative"
    assert route["cell"]["workload"] == "big_paste"


def test_decide_turn_one_and_weights(capsys):
    main(["table", "decide", TABLE, "--turn", "1", "--n-in", "10", "--n-out", "10", "--ctx", "0", "--qps", "1"])
    assert json.loads(capsys.readouterr().out)["reason"] == "turn1"
    args = ["table", "decide", TABLE, "--turn", "2", "--n-in", "512", "--n-out", "64", "--ctx", "2000", "--qps", "16"]
    main(args)
    assert json.loads(capsys.readouterr().out)["path"] == "local"
    main(args + ["--w-tpot", "100"])
    assert json.loads(capsys.readouterr().out)["path"] == "pd"


def test_show_prints_every_cell_decision(capsys):
    assert main(["table", "show", TABLE]) == 0
    out = capsys.readouterr().out
    assert "context huge" in out and "big_paste" in out
    sections = out.split("\ncontext ")[1:]
    assert [s.split()[0] for s in sections] == ["small", "large", "huge"]
    grids = [[line.split()[1:] for line in s.splitlines()[2:11]] for s in sections]
    # No huge-context point was measured: every huge entry is the large one, marked as a fallback.
    assert all(e.startswith("~") for row in grids[2] for e in row)
    flat = lambda g: [e.lstrip("~") for row in g for e in row]
    assert flat(grids[2]) == flat(grids[1])
    n_local = sum(e.startswith("L") for g in grids for e in flat(g))
    assert f"local in {n_local} of 270 grid points" in out


def test_bad_input_exits_2_with_a_message(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r = subprocess.run([sys.executable, "-m", "ppd_router.cli", "table", "show", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "bad.json" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "ppd_router.cli", "table", "decide", TABLE, "--turn", "2", "--n-in", "-4",
                        "--n-out", "1", "--ctx", "1", "--qps", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "n_in" in r.stderr


def serve_flags() -> set[str]:
    from ppd_router.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {a.dest for a in sub.choices["serve"]._actions}


def test_every_router_setting_has_a_serve_flag(capsys):
    # The TOML file and the flags share one schema: a setting the Rust config knows but no flag
    # sets could only be reached through a file.
    assert main(["serve", "--prefill", "http://127.0.0.1:1", "--pd-capable", "http://127.0.0.1:2",
                 "--print-config"]) == 0
    settings = set(json.loads(capsys.readouterr().out))
    assert settings - serve_flags() == set()


def test_worker_threads_flag_reaches_the_router_config_and_is_range_checked(capsys):
    base = ["serve", "--prefill", "http://127.0.0.1:1", "--pd-capable", "http://127.0.0.1:2", "--print-config"]
    assert main(base + ["--worker-threads", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["worker_threads"] == 1
    assert main(base + ["--worker-threads", "5000"]) == 2
    assert "worker_threads" in capsys.readouterr().err


def test_runtime_flag_reaches_the_router_config_and_a_bad_one_is_refused_by_name(capsys):
    base = ["serve", "--prefill", "http://127.0.0.1:1", "--pd-capable", "http://127.0.0.1:2", "--print-config"]
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out)["runtime"] == "thread-per-core"
    assert main(base + ["--runtime", "work-stealing"]) == 0
    assert json.loads(capsys.readouterr().out)["runtime"] == "work-stealing"
    assert main(base + ["--runtime", "fibers"]) == 2
    assert "runtime" in capsys.readouterr().err
