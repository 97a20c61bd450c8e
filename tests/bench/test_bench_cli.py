"""Bad bench input exits 2 with one clear message and no traceback."""

from __future__ import annotations

import socket

import pytest
from ppd_router.cli import main


def _closed_port() -> int:
    # Bind and release: nothing listens there afterwards.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BASE = ["bench", "--target", "http://127.0.0.1:9", "--workload", "small_tiny",
        "--qps", "1", "--duration", "1", "--json"]


def _with(**changes: str) -> list[str]:
    argv = list(BASE)
    for k, v in changes.items():
        flag = "--" + k.replace("_", "-")
        if flag in argv:
            argv[argv.index(flag) + 1] = v
        else:
            argv += [flag, v]
    return argv


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (_with(workload="no_such_workload"), "unknown workload"),
        (_with(target="ftp://example"), "http(s) URL"),
        (_with(target="not a url"), "http(s) URL"),
        (_with(target="http://127.0.0.1:notaport"), "bad port"),
        (_with(qps="0"), "must be positive"),
        (_with(qps="-2"), "must be positive"),
        (_with(qps="fast"), "not a number"),
        (_with(duration="0"), "must be positive"),
        (_with(timeout="-1"), "must be positive"),
        (_with(think_time="-1"), "must be >= 0"),
        (_with(turns="1"), "2..16"),
        (_with(turns="17"), "2..16"),
        (_with(workload="wildchat-like", turns="3"), "--max-turns"),
        (_with(slo_ttft_ms="150"), "go together"),
        (_with(slo_tpot_ms="0"), "must be positive"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(argv, message, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err
    assert "Traceback" not in err


def test_unreachable_target_exits_2(capsys):
    rc = main(_with(target=f"http://127.0.0.1:{_closed_port()}"))
    err = capsys.readouterr().err
    assert rc == 2 and "cannot reach" in err and "Traceback" not in err


def test_missing_workload_file_is_unknown_workload(tmp_path, capsys):
    rc = main(_with(workload=str(tmp_path / "nope.json")))
    assert rc == 2 and "unknown workload" in capsys.readouterr().err
