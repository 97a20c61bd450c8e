"""A flood of idle connections against a router process with default settings: capped, answered, and memory returns."""

from __future__ import annotations

import os
import resource
import select
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers import free_port

from .conftest import DEAD_NODE

FLOOD = 10000  # well over the default max_connections (4096)
DEFAULT_MAX_CONNECTIONS = 4096
# The refusals the router answers at once (each lingers ~2 s) and its own descriptors.
SLACK_FDS = 512 + 64
MIB = 1 << 20


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def settle(measure, seconds: float = 1.0, timeout: float = 8.0) -> int:
    """The measure once it has stopped changing for `seconds` (or at `timeout`)."""
    last, since = measure(), time.monotonic()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = measure()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= seconds:
            break
    return last


@pytest.mark.parametrize("runtime", ["thread-per-core", "work-stealing"])
def test_a_flood_of_idle_connections_is_capped_answered_503_and_its_memory_returns(runtime):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FLOOD + 1000
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {need}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    port = free_port()
    cmd = [sys.executable, "-m", "ppd_router.cli", "serve", "--replica", DEAD_NODE, "--policy", "replica",
           "--port", str(port), "--runtime", runtime, "--health-interval", "60"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    socks: list[socket.socket] = []
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "router did not start"
            time.sleep(0.05)
        with httpx.Client() as c:  # warm up the request path once
            for _ in range(20):
                c.get(url + "/v1/models")
        rss_before = settle(lambda: rss(proc.pid))
        fds_before = fds(proc.pid)

        for _ in range(FLOOD):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.setblocking(False)
            socks.append(s)
        fds_flood = settle(lambda: fds(proc.pid), seconds=0.5)
        rss_flood = rss(proc.pid)

        # Over the cap, connections are answered 503 (as many as the router refuses at
        # once) or closed; none is left hanging in an accept backlog.
        answered, closed, refused = 0, 0, 0
        poller = select.poll()
        by_fd = {s.fileno(): s for s in socks}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + 8
        while by_fd and time.monotonic() < deadline and answered + closed < FLOOD - DEFAULT_MAX_CONNECTIONS:
            for fd, _ in poller.poll(200):
                s = by_fd.pop(fd)
                poller.unregister(fd)
                try:
                    data = s.recv(4096)
                except (ConnectionResetError, BlockingIOError):
                    closed += 1
                    continue
                if data.startswith(b"HTTP/1.1 503"):
                    answered += 1
                    assert b"retry-after: 1" in data.lower() and b'"too_many_connections"' in data
                elif data:
                    refused += 1
                else:
                    closed += 1
        print(f"\nflood of {FLOOD} ({runtime}): 503 {answered}, closed {closed}, other {refused}; "
              f"router fds {fds_before} -> {fds_flood}; RSS {rss_before / MIB:.1f} -> {rss_flood / MIB:.1f} MiB")
        assert refused == 0
        assert answered > 0
        assert answered + closed >= FLOOD - DEFAULT_MAX_CONNECTIONS - 64
        assert fds_flood <= fds_before + DEFAULT_MAX_CONNECTIONS + SLACK_FDS
        assert rss_flood <= rss_before + 64 * MIB

        for s in socks:
            s.close()
        socks.clear()
        fds_after = settle(lambda: fds(proc.pid), seconds=0.5)
        rss_after = settle(lambda: rss(proc.pid))
        print(f"after: router fds {fds_after}, RSS {rss_after / MIB:.1f} MiB")
        assert fds_after <= fds_before + 8
        assert rss_after <= rss_before + 64 * MIB
        # and it still serves
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 200
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
