"""Router replicas share admin changes through Redis (``--state``): a change made through one replica's
admin API reaches the others within 1 s, a replica that loses Redis serves on and says so, and what was
changed during the outage reaches the others once Redis is back."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import httpx
import pytest

from ppd_router import ConfigError, Router
from tests.helpers import free_port
from tests.router.conftest import Node, start_node, wait_healthy

TOKEN = "secret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
ROOT = Path(__file__).resolve().parents[2]

needs_redis = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is not installed (Debian: apt-get install redis-server; scripts/test.sh installs it)",
)


class Certs:
    """A CA of our own and a certificate it signed for 127.0.0.1 (openssl's command line)."""

    def __init__(self, d: Path) -> None:
        self.ca, self.cert, self.key = str(d / "ca.pem"), str(d / "server.pem"), str(d / "server.key")
        ext = d / "san.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1\n")
        for cmd in (
            ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "ca.key"), "-out", self.ca,
             "-days", "1", "-subj", "/CN=ppd-test-ca"],
            ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", self.key, "-out", str(d / "server.csr"),
             "-subj", "/CN=127.0.0.1"],
            ["x509", "-req", "-in", str(d / "server.csr"), "-CA", self.ca, "-CAkey", str(d / "ca.key"),
             "-CAcreateserial", "-out", self.cert, "-days", "1", "-extfile", str(ext)],
        ):  # fmt: skip
            subprocess.run(["openssl", *cmd], check=True, capture_output=True)


class Redis:
    """A redis-server of our own on 127.0.0.1, without persistence (a restart loses every key); over TLS
    only with ``certs``."""

    def __init__(self, workdir: str, certs: Optional[Certs] = None) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.certs = certs
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    @property
    def url(self) -> str:
        return f"{'rediss' if self.certs else 'redis'}://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", self.workdir]  # fmt: skip
        if self.certs:
            cmd[1:3] = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.certs.cert,
                        "--tls-key-file", self.certs.key, "--tls-ca-cert-file", self.certs.ca,
                        "--tls-auth-clients", "no"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "redis-server exited at start"
            try:
                with self._connect() as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError("redis-server did not answer PING")

    def _connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
        if not self.certs:
            return s
        return ssl.create_default_context(cafile=self.certs.ca).wrap_socket(s, server_hostname="127.0.0.1")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


class Replica:
    """``ppd-router serve`` in a process of its own, with the admin API and the shared state."""

    def __init__(self, node: Node, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "ppd_router.cli", "serve", "--replica", node.url, "--port", str(self.port),
               "--health-interval", "0.5", "--load-interval", "0", "--log", "info", *flags]  # fmt: skip
        env = {**os.environ, "PPD_ADMIN_TOKEN": TOKEN}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, env=env)
        try:
            wait_healthy(self.url, proc=self.proc)
        except Exception:
            self.stop()
            raise

    def get(self, path: str) -> Any:
        r = httpx.get(self.url + path, headers=AUTH, timeout=5)
        assert r.status_code == 200, r.text
        return r.json()

    def send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, self.url + path, headers=AUTH, timeout=10, **kw)

    def health(self) -> Any:
        r = httpx.get(self.url + "/health", timeout=5)
        assert r.status_code == 200, r.text
        return r.json()

    def chat(self) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        return httpx.post(self.url + "/v1/chat/completions", json=body, timeout=30)

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def metric(url: str, name: str, **labels: str) -> float:
    """The value of a metric sample with exactly these labels (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    sample = f"{name}{{{want}}}" if want else name
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == sample:
            return float(value)
    return 0.0


def eventually(check: Callable[[], bool], within: float) -> float:
    """Seconds until ``check()`` holds, polling; fails past ``within``."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < within, f"not within {within} s"
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = start_node("R")
    yield n
    n.kill()


@pytest.fixture
def redis() -> Iterator[Redis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; scripts/test.sh installs it)")
    with tempfile.TemporaryDirectory() as d:
        r = Redis(d)
        yield r
        r.kill()


@pytest.fixture
def replicas(node: Node, redis: Redis) -> Iterator[Callable[..., list[Replica]]]:
    made: list[Replica] = []

    def make(n: int, *flags: str) -> list[Replica]:
        for _ in range(n):
            made.append(Replica(node, "--state", redis.url, *flags))
        # Each has caught up with the store before the test changes anything.
        for r in made[-n:]:
            eventually(lambda r=r: r.health()["state"]["connected"], within=10)
        return made[-n:]

    yield make
    for r in made:
        r.stop()


@needs_redis
def test_a_weight_change_through_one_replica_takes_effect_on_all_three_within_a_second(replicas):
    a, b, c = replicas(3)
    put = a.send("PUT", "/admin/weights", json={"w_ttft": 1, "w_tpot": 3.5})
    assert put.status_code == 200, put.text
    shared = put.json()["shared"]
    assert shared["stored"] is True and shared["version"] >= 1
    took = eventually(lambda: all(r.get("/admin/weights") == {"w_ttft": 1.0, "w_tpot": 3.5} for r in (b, c)), 1.0)
    assert took < 1.0
    assert a.get("/admin/weights") == {"w_ttft": 1.0, "w_tpot": 3.5}
    # The others count it applied; the one that made it counts it sent, and applies its own echo never.
    assert metric(b.url, "ppd_state_updates_total", outcome="applied") == 1
    assert metric(a.url, "ppd_state_updates_total", outcome="sent") == 1
    assert metric(a.url, "ppd_state_updates_total", outcome="applied") == 0


@needs_redis
def test_replicas_changing_the_same_weights_at_once_agree_on_the_newest_stored(replicas):
    a, b, c = replicas(3)

    def put(r: Replica, i: int) -> tuple[int, dict[str, float]]:
        w = {"w_ttft": 1.0, "w_tpot": float(i)}
        resp = r.send("PUT", "/admin/weights", json=w)
        assert resp.status_code == 200, resp.text
        return resp.json()["shared"]["version"], w

    with ThreadPoolExecutor(8) as pool:
        stored = list(pool.map(lambda i: put((a, b)[i % 2], i), range(1, 41)))
    newest = max(stored)[1]
    eventually(lambda: all(r.get("/admin/weights") == newest for r in (a, b, c)), 2)


@needs_redis
def test_nodes_policy_and_table_changes_reach_the_other_replicas(replicas, node, tmp_path):
    a, b = replicas(2)
    extra = "http://127.0.0.1:9"
    assert a.send("POST", "/admin/nodes", json={"url": extra, "role": "D"}).status_code == 201
    eventually(lambda: extra in {n["url"] for n in b.get("/admin/nodes")["nodes"]}, 5)
    added = next(n for n in b.get("/admin/nodes")["nodes"] if n["url"] == extra)
    assert (added["role"], added["source"]) == ("D", "admin")

    # Removed through the other replica: gone from both.
    assert b.send("DELETE", "/admin/nodes", params={"url": extra}).status_code == 200
    eventually(lambda: extra not in {n["url"] for n in a.get("/admin/nodes")["nodes"]}, 5)

    assert a.send("PUT", "/admin/policy", json={"policy": "fraction:0.25"}).status_code == 200
    eventually(lambda: b.get("/admin/policy") == {"policy": "fraction:0.25"}, 5)

    # A table is shared by content: b gets it although the file is gone by then.
    table = tmp_path / "t.json"
    shutil.copy(ROOT / "tables" / "h100-llama3.1-8b-1P3pD.json", table)
    reloaded = a.send("POST", "/admin/table/reload", json={"path": str(table)})
    assert reloaded.status_code == 200, reloaded.text
    table.unlink()
    eventually(lambda: b.get("/admin/table")["source"] == str(table), 5)
    assert b.get("/admin/table")["table"] == a.get("/admin/table")["table"]


@needs_redis
def test_a_replica_started_later_catches_up_and_a_refused_change_is_not_shared(replicas):
    (a,) = replicas(1)
    assert a.send("PUT", "/admin/weights", json={"w_ttft": 2, "w_tpot": 1}).status_code == 200
    bad = a.send("PUT", "/admin/weights", json={"w_ttft": -1, "w_tpot": 1})
    assert bad.status_code == 400 and "shared" not in bad.json()
    (late,) = replicas(1)
    assert late.get("/admin/weights") == {"w_ttft": 2.0, "w_tpot": 1.0}


@needs_redis
def test_replicas_under_other_prefixes_do_not_share(replicas):
    (a,) = replicas(1)
    (other,) = replicas(1, "--state-prefix", "other-cluster")
    assert a.send("PUT", "/admin/weights", json={"w_ttft": 1, "w_tpot": 7}).status_code == 200
    (same,) = replicas(1)
    assert same.get("/admin/weights") == {"w_ttft": 1.0, "w_tpot": 7.0}
    assert other.get("/admin/weights") == {"w_ttft": 1.0, "w_tpot": 1.0}


@needs_redis
def test_losing_redis_keeps_serving_and_the_outages_change_reaches_the_others_after(replicas, redis):
    a, b, c = replicas(3)
    redis.kill()
    for r in (a, b, c):
        eventually(lambda r=r: not r.health()["state"]["connected"], within=10)
    health = a.health()
    assert health["status"] == "ok" and health["state"]["backend"] == "redis"
    assert metric(a.url, "ppd_state_connected") == 0
    assert a.chat().status_code == 200
    assert "state store lost" in a.stderr()

    # Changed during the outage: in force here at once, not shared yet.
    put = a.send("PUT", "/admin/weights", json={"w_ttft": 1, "w_tpot": 5})
    assert put.status_code == 200
    assert put.json()["shared"]["stored"] is False and put.json()["shared"]["pending"] is True
    assert a.get("/admin/weights") == {"w_ttft": 1.0, "w_tpot": 5.0}
    assert b.get("/admin/weights") == {"w_ttft": 1.0, "w_tpot": 1.0}
    assert a.health()["state"]["pending"] == 1

    redis.start()  # the same port, empty
    for r in (a, b, c):
        eventually(lambda r=r: r.health()["state"]["connected"], within=10)
    eventually(lambda: all(r.get("/admin/weights") == {"w_ttft": 1.0, "w_tpot": 5.0} for r in (b, c)), 5)
    assert a.health()["state"]["pending"] == 0
    assert metric(a.url, "ppd_state_connected") == 1
    assert "state store connected" in a.stderr()
    # And sharing works on as before.
    assert b.send("PUT", "/admin/weights", json={"w_ttft": 4, "w_tpot": 1}).json()["shared"]["stored"] is True
    eventually(lambda: a.get("/admin/weights") == {"w_ttft": 4.0, "w_tpot": 1.0}, 1.0)


@needs_redis
def test_each_replica_decides_with_the_fleets_conversation_rate_and_forgets_a_stopped_replica(replicas):
    a, b, c = replicas(3)
    eventually(lambda: all(r.health()["state"]["other_replicas"] == 2 for r in (a, b, c)), within=3)
    for _ in range(8):  # new conversations, all through a
        assert a.chat().status_code == 200
    own_a = a.get("/admin/stats")["qps"]
    assert own_a > 0
    # b and c saw none of them, yet decide with a's rate once a has reported it (every second).
    eventually(lambda: all(r.get("/admin/stats")["fleet_qps"] > 0 for r in (b, c)), within=3)
    for r in (b, c):
        stats = r.get("/admin/stats")
        assert stats["qps"] == 0
        assert 0 < stats["fleet_qps"] <= 1.5 * own_a
        assert r.health()["state"]["other_replicas_qps"] == stats["fleet_qps"]
    assert a.get("/admin/stats")["fleet_qps"] == pytest.approx(a.get("/admin/stats")["qps"], abs=0.5)
    # A stopped replica stops counting once it has missed five reports.
    a.stop()
    eventually(lambda: b.health()["state"]["other_replicas"] == 1, within=10)
    assert b.get("/admin/stats")["fleet_qps"] == 0


@needs_redis
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl's command line makes the test's CA")
def test_replicas_share_through_a_tls_store_that_they_trust_by_its_ca_only(node, tmp_path):
    certs = Certs(tmp_path)
    store = Redis(str(tmp_path), certs)
    made: list[Replica] = []
    try:
        a, b = (Replica(node, "--state", store.url, "--state-ca-file", certs.ca) for _ in range(2))
        made += [a, b]
        for r in (a, b):
            eventually(lambda r=r: r.health()["state"]["connected"], within=10)
        assert a.send("PUT", "/admin/weights", json={"w_ttft": 1, "w_tpot": 6}).json()["shared"]["stored"] is True
        eventually(lambda: b.get("/admin/weights") == {"w_ttft": 1.0, "w_tpot": 6.0}, 1.0)
        # Without the CA, the public web roots do not vouch for this store: serving on, unshared, saying why.
        untrusting = Replica(node, "--state", store.url)
        made.append(untrusting)
        eventually(lambda: "state store unreachable" in untrusting.stderr(), within=10)
        assert untrusting.health()["state"]["connected"] is False
        assert "certificate" in untrusting.stderr().lower()
        assert untrusting.chat().status_code == 200
    finally:
        for r in made:
            r.stop()
        store.kill()


def test_a_state_url_that_is_not_redis_is_refused_by_name(tmp_path):
    for url in ("http://127.0.0.1:6379", "https://cache:6380", "redis//nohost"):
        with pytest.raises(ConfigError, match="state"):
            Router(f'{{"replica": ["http://127.0.0.1:9"], "state": "{url}"}}')
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="state_ca_file.*rediss://"):
        Router(f'{{"replica": ["http://127.0.0.1:9"], "state": "redis://cache", "state_ca_file": "{ca}"}}')
    with pytest.raises(ConfigError, match="state_prefix"):
        Router('{"replica": ["http://127.0.0.1:9"], "state_prefix": "has space"}')


def test_without_state_health_and_metrics_say_nothing_of_it(node):
    port = free_port()
    router = Router(f'{{"replica": ["{node.url}"], "port": {port}, "health_interval": 0.5}}')
    url = router.start()
    try:
        wait_healthy(url)
        assert "state" not in httpx.get(url + "/health").json()
        assert "ppd_state_connected" not in httpx.get(url + "/metrics").text
    finally:
        router.stop()
