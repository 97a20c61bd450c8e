"""The admin API's token (compared as given; from a flag, a file or the environment) and its own listener."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from ppd_router import ConfigError, Router
from ppd_router.cli import main
from tests.helpers import free_port

from .conftest import DEAD_NODE


def admin_get(url: str, path: str, token: str) -> httpx.Response:
    return httpx.get(url + path, headers={"authorization": f"Bearer {token}"}, timeout=10)


def test_the_presented_token_is_compared_as_given(serve):
    r = serve(admin_token="secret")
    assert admin_get(r.url, "/admin/weights", "secret").status_code == 200
    for wrong in [" secret", "secre", "secretx", "Secret"]:
        resp = admin_get(r.url, "/admin/weights", wrong)
        assert resp.status_code == 401, repr(wrong)
        assert resp.json()["error"]["code"] == "bad_token"
    # a lower-case scheme, or none, is not the token either
    resp = httpx.get(r.url + "/admin/weights", headers={"authorization": "secret"}, timeout=10)
    assert resp.status_code == 401


def test_the_admin_token_can_come_from_the_environment(serve, monkeypatch):
    monkeypatch.setenv("PPD_ADMIN_TOKEN", "from-env")
    r = serve()
    assert admin_get(r.url, "/admin/weights", "from-env").status_code == 200
    assert admin_get(r.url, "/admin/weights", "other").status_code == 401


def test_the_admin_token_can_come_from_a_file_and_a_setting_wins_over_the_environment(serve, monkeypatch, tmp_path):
    monkeypatch.setenv("PPD_ADMIN_TOKEN", "from-env")
    f = tmp_path / "token"
    f.write_text("from-file\n")  # the trailing newline is not part of the token
    r = serve(admin_token_file=str(f))
    assert admin_get(r.url, "/admin/weights", "from-file").status_code == 200
    assert admin_get(r.url, "/admin/weights", "from-env").status_code == 401
    r = serve(admin_token="from-flag")
    assert admin_get(r.url, "/admin/weights", "from-flag").status_code == 200
    assert admin_get(r.url, "/admin/weights", "from-env").status_code == 401


def test_bad_token_sources_are_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.delenv("PPD_ADMIN_TOKEN", raising=False)
    f = tmp_path / "token"
    f.write_text("t\n")
    base = {"replica": [DEAD_NODE]}
    with pytest.raises(ConfigError, match=r"admin_token_file.*not both"):
        Router(json.dumps({**base, "admin_token": "t", "admin_token_file": str(f)}))
    with pytest.raises(ConfigError, match="admin_token_file"):
        Router(json.dumps({**base, "admin_token_file": str(tmp_path / "missing")}))
    for content in ["\n", "tok en\n", "token \n", "token\n\n"]:
        f.write_text(content)  # only one trailing newline is stripped, nothing else
        with pytest.raises(ConfigError, match="admin_token_file"):
            Router(json.dumps({**base, "admin_token_file": str(f)}))
    with pytest.raises(ConfigError, match="admin_token"):
        Router(json.dumps({**base, "admin_token": "has space"}))
    monkeypatch.setenv("PPD_ADMIN_TOKEN", "bad token")
    with pytest.raises(ConfigError, match="PPD_ADMIN_TOKEN"):
        Router(json.dumps(base))


def test_a_token_from_a_file_or_the_environment_is_never_printed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PPD_ADMIN_TOKEN", "env-secret-value")
    f = tmp_path / "token"
    f.write_text("file-secret-value\n")
    assert main(["serve", "--replica", DEAD_NODE, "--admin-token-file", str(f), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["admin_token_file"] == str(f)
    assert "file-secret-value" not in out and "env-secret-value" not in out


def test_admin_and_metrics_on_their_own_port(serve):
    admin_port = free_port()
    r = serve(admin_token="secret", admin_port=admin_port)
    admin = f"http://127.0.0.1:{admin_port}"
    # The main port no longer knows them.
    for path in ["/admin/weights", "/admin/nodes", "/metrics"]:
        resp = admin_get(r.url, path, "secret")
        assert resp.status_code == 404, path
        assert resp.json()["error"]["code"] == "not_found"
    assert httpx.get(r.url + "/v1/models", timeout=10).status_code == 200
    # The admin port serves them, with the same token rule, and nothing else.
    assert admin_get(admin, "/admin/weights", "secret").json() == {"w_ttft": 1.0, "w_tpot": 1.0}
    assert admin_get(admin, "/admin/weights", "wrong").status_code == 401
    metrics = httpx.get(admin + "/metrics", timeout=10)
    assert metrics.status_code == 200 and "ppd_nodes" in metrics.text
    resp = httpx.get(admin + "/v1/models", timeout=10)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"


def test_admin_listener_settings_are_checked(serve):
    base = {"replica": [DEAD_NODE], "port": 8123}
    for extra, field in [
        ({"admin_port": 8123}, "admin_port"),
        ({"admin_port": 0}, "admin_port"),
        ({"admin_host": "127.0.0.1"}, "admin_host"),
    ]:
        with pytest.raises(ConfigError, match=field):
            Router(json.dumps({**base, **extra}))
    # The same port on another address is fine.
    Router(json.dumps({**base, "admin_port": 8123, "admin_host": "127.0.0.2"}))


def test_an_admin_port_in_use_fails_the_start_by_name():
    from ppd_router.errors import RunError

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        r = Router(json.dumps({"replica": [DEAD_NODE], "port": free_port(), "admin_port": taken.getsockname()[1]}))
        with pytest.raises(RunError, match="admin_port"):
            r.start()
    finally:
        taken.close()
