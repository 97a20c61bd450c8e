"""The emulator through its Python surface: in-process clusters, the NIXL exchange, the CLI."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from ppd_router import _core


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_layouts_parse_in_the_papers_notation():
    assert _core.parse_layout("1P_1D_2pD") == ["P", "D", "pD", "pD"]
    assert _core.parse_layout("2P2pD") == ["P", "P", "pD", "pD"]
    assert _core.parse_layout("4R") == ["R"] * 4
    with pytest.raises(ValueError, match="layout"):
        _core.parse_layout("2X")


def test_builtin_profile_loads_with_the_llama_kv_size():
    p = json.loads(_core.load_profile("h100-llama3.1-8b"))
    assert p["kv_bytes_per_token"] == 131072
    with pytest.raises(ValueError, match="not a readable file"):
        _core.load_profile("/nonexistent.toml")


def test_nixl_variant_of_the_builtin_profile_drops_only_the_p2pnccl_costs():
    base = json.loads(_core.load_profile("h100-llama3.1-8b"))
    nixl = json.loads(_core.load_profile("h100-llama3.1-8b-nixl"))
    assert base["link"]["full_prompt_transfer"] and base["link"]["push_ms"] > 0
    assert nixl["link"]["full_prompt_transfer"] is False and nixl["link"]["push_ms"] == 0
    assert nixl["step"] == base["step"] and nixl["link"]["gbps"] == base["link"]["gbps"]


def test_cluster_moves_kv_from_p_to_pd_and_caches_the_next_turn():
    with _core.start_emulated_cluster("1P1pD", seed=1) as c:
        p, d = c.urls
        assert c.roles == ["P", "pD"]
        msgs = [{"role": "user", "content": "tell me " * 100}]
        status, pv = post(f"{p}/v1/chat/completions", {
            "messages": msgs, "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                   "remote_block_ids": None, "remote_host": None, "remote_port": None}})
        assert status == 200
        kv = pv["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["remote_request_id"] == pv["id"]
        status, dv = post(f"{d}/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "kv_transfer_params": kv})
        assert status == 200
        prompt = dv["usage"]["prompt_tokens"]
        assert dv["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
        # Turn 2 locally on the pD: the prompt and answer of turn 1 are in its prefix cache.
        answer = dv["choices"][0]["message"]["content"]
        msgs2 = msgs + [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
        status, v2 = post(f"{d}/v1/chat/completions", {"messages": msgs2, "max_tokens": 4})
        assert status == 200
        assert v2["usage"]["prompt_tokens_details"]["cached_tokens"] >= (prompt + 8 - 1) // 16 * 16
    c.shutdown()  # idempotent


def test_bad_cluster_settings_raise_value_errors():
    with pytest.raises(ValueError, match="kv_blocks"):
        _core.start_emulated_cluster("1R", kv_blocks=0)
    with pytest.raises(ValueError, match="layout"):
        _core.start_emulated_cluster("")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from ppd_router.cli import main; sys.exit(main())", *args]


def test_emulate_cli_serves_until_sigterm():
    port = free_port()
    proc = subprocess.Popen(_cli("emulate", "--role", "P", "--port", str(port), "--seed", "3"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    assert r.status == 200
                    break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline, "node did not come up"
                time.sleep(0.1)
        status, v = post(f"http://127.0.0.1:{port}/v1/completions", {"prompt": "hello there", "max_tokens": 3})
        assert status == 200 and v["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_emulate_cli_reports_bad_settings():
    r = subprocess.run(_cli("emulate", "--role", "R", "--port", str(free_port()), "--kv-blocks", "0"),
                       capture_output=True, text=True, timeout=30, env=os.environ)
    assert r.returncode == 2
    assert "kv_blocks" in r.stderr
