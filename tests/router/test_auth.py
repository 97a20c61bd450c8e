"""Auth to and from the router: the router's own api_key for clients, upstream_api_key to keyed vLLM
nodes (emulated with --api-key, checked like vLLM's: Bearer on /v1/* only), and the client's
Authorization passed on only when the router has neither key."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from ppd_router import ConfigError, Router
from ppd_router.cli import main
from tests.helpers import user

from .conftest import Cluster, kill_all, router_over, start_node

NODE_KEY = "node-key"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.fixture
def keyed():
    """Starts keyed emulated nodes ({kind: n}) and a router over them; stops everything after the test."""
    made: list[Cluster] = []

    def make(layout: dict[str, int], **cfg) -> Cluster:
        roles = {"P": "P", "pD": "D", "R": "R"}
        nodes: dict = {}
        try:
            for kind, n in layout.items():
                nodes[kind] = [start_node(roles[kind], "--api-key", NODE_KEY) for _ in range(n)]
        except Exception:
            kill_all(nodes)
            raise
        c = router_over(nodes, **cfg)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_the_emulator_guards_only_v1_like_vllm(keyed):
    c = keyed({"R": 1}, policy="replica")
    node = c.nodes["R"][0].url
    assert httpx.get(node + "/health", timeout=10).status_code == 200
    assert httpx.get(node + "/metrics", timeout=10).status_code == 200
    r = httpx.get(node + "/v1/models", timeout=10)
    assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
    assert httpx.get(node + "/v1/models", headers=bearer(NODE_KEY), timeout=10).status_code == 200


def test_the_upstream_key_reaches_every_node_call(keyed):
    c = keyed({"P": 1, "pD": 1}, upstream_api_key=NODE_KEY, policy="pd")
    r = c.chat([user("hello there")])
    assert r.status_code == 200, r.text
    assert r.headers["x-ppd-path"] == "pd"  # P's prefill and D's decode both took the key
    # The health checks' /v1/models answered with the key: the router lists the nodes' model.
    deadline = time.monotonic() + 10
    models: list = []
    while time.monotonic() < deadline and not models:
        models = [m["id"] for m in c.client.get(c.url + "/v1/models").json()["data"]]
        time.sleep(0.1)
    assert models == [MODEL]
    # Health checks and scrapes went through: the nodes are healthy and scraped.
    nodes = c.admin("GET", "/admin/nodes").json()["nodes"]
    assert {n["state"] for n in nodes} == {"healthy"}


def test_without_keys_the_clients_authorization_is_passed_on(keyed):
    c = keyed({"R": 1}, policy="replica")
    refused = c.chat([user("hi")])
    assert refused.status_code == 401  # the node's refusal, passed on
    r = c.chat([user("hi")], headers=bearer(NODE_KEY))
    assert r.status_code == 200, r.text


def test_the_routers_api_key_guards_v1_and_is_never_passed_on(keyed):
    c = keyed({"R": 1}, policy="replica", api_key="router-key", upstream_api_key=NODE_KEY)
    for headers in [{}, bearer("wrong"), {"authorization": "router-key"}, {"authorization": "bearer router-key"}]:
        r = c.chat([user("hi")], headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["type"] == "authentication_error"
    assert c.client.get(c.url + "/v1/models").status_code == 401
    assert c.chat([user("hi")], headers=bearer("router-key")).status_code == 200
    assert c.client.get(c.url + "/v1/models", headers=bearer("router-key")).status_code == 200
    # /health and /metrics stay open.
    assert c.client.get(c.url + "/health").status_code == 200
    assert c.client.get(c.url + "/metrics").status_code == 200


def test_with_only_the_routers_key_the_client_token_stays_at_the_router(keyed):
    # The client's key is the router's own: the keyed node never sees it, so it refuses.
    c = keyed({"R": 1}, policy="replica", api_key=NODE_KEY)
    assert c.chat([user("hi")], headers=bearer(NODE_KEY)).status_code == 401
    assert c.nodes["R"][0].served() == 0


def test_unusable_node_urls_are_refused_at_start_naming_the_setting():
    for setting, url in [("replica", "ftp://127.0.0.1:1"), ("prefill", "http://127.0.0.1:99999"),
                         ("decode", "https://")]:
        with pytest.raises(ConfigError, match=setting):
            Router(json.dumps({setting: [url]}))
    with pytest.raises(ConfigError, match="upstream_ca_file"):
        Router(json.dumps({"replica": ["https://127.0.0.1:1"], "upstream_ca_file": "/nonexistent/ca.pem"}))
    Router(json.dumps({"replica": ["https://127.0.0.1:1"]}))  # https is taken


def test_keys_are_never_printed(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PPD_UPSTREAM_API_KEY", "env-upstream-value")
    monkeypatch.setenv("PPD_API_KEY", "env-client-value")
    f = tmp_path / "key"
    f.write_text("file-client-value\n")
    assert main(["serve", "--replica", "http://127.0.0.1:9", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "env-upstream-value" not in out and "env-client-value" not in out
    assert main(["serve", "--replica", "http://127.0.0.1:9", "--upstream-api-key", "flag-value",
                 "--api-key-file", str(f), "--print-config"]) == 0
    out = capsys.readouterr().out
    shown = json.loads(out)
    assert shown["upstream_api_key"] == "<set>" and shown["api_key_file"] == str(f)
    assert "flag-value" not in out and "file-client-value" not in out
