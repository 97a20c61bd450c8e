"""Command-line conventions shared with vllm-router and SMG: repeated node flags add up, their
spellings are accepted, no flag is matched by a prefix, secrets come from the environment, and
``launch --dry-run`` needs no vLLM."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from ppd_router.cli import build_parser, main, subparsers_of

P1, P2, P3 = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"
D1 = "http://127.0.0.1:9"


def printed_config(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["serve", *args, "--print-config"]) == 0
    return json.loads(capsys.readouterr().out)


def test_repeated_prefill_flags_add_every_node(capsys):
    settings = printed_config(capsys, "--prefill", P1, "--prefill", P2, "--pd-capable", D1)
    assert settings["prefill"] == [P1, P2]


def test_several_urls_after_one_flag_and_repeats_mix(capsys):
    settings = printed_config(capsys, "--prefill", P1, P2, "--prefill", P3, "--decode", D1)
    assert settings["prefill"] == [P1, P2, P3]
    assert settings["decode"] == [D1]


def test_vllm_router_spellings_reach_the_same_settings(capsys):
    settings = printed_config(
        capsys,
        "--pd-disaggregation",
        "--worker-urls", P1, "--worker-urls", P2,
        "--request-timeout-secs", "42",
        "--max-payload-size", "1048576",
        "--health-check-interval-secs", "7",
    )  # fmt: skip
    assert settings["replica"] == [P1, P2]
    assert settings["request_timeout"] == 42
    assert (settings["max_body_bytes"], settings["health_interval"]) == (1048576, 7)


def test_a_prefix_of_a_flag_is_refused_not_guessed(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--prefill", P1, "--pd-capable", D1, "--session-t", "5", "--print-config"])
    assert e.value.code == 2
    assert "--session-t" in capsys.readouterr().err


def test_no_parser_matches_abbreviations():
    parser = build_parser()
    parsers = [parser, *subparsers_of(parser)]
    assert len(parsers) > 10  # every command and the table subcommands
    assert [p.prog for p in parsers if p.allow_abbrev] == []


def test_bench_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    args = build_parser().parse_args(["bench", "--target", P1, "--workload", "small_tiny", "--qps", "1", "--duration", "1"])
    assert args.api_key == "sk-from-env"


def test_admin_token_comes_from_the_environment_and_is_never_printed(capsys, monkeypatch):
    monkeypatch.setenv("PPD_ADMIN_TOKEN", "secret-from-env")
    assert main(["serve", "--prefill", P1, "--pd-capable", D1, "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "secret-from-env" not in out
    serve = next(p for p in subparsers_of(build_parser()) if p.prog.endswith(" serve"))
    assert "PPD_ADMIN_TOKEN" in serve.format_help()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this interpreter")
def test_launch_dry_run_needs_no_vllm():
    env = {k: v for k, v in os.environ.items() if k != "PPD_VLLM_PYTHON"}
    r = subprocess.run(
        [sys.executable, "-m", "ppd_router.cli", "launch", "--model", "org/model", "--layout", "1P_1pD", "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert "python3" in json.dumps(plan)
