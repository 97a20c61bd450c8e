"""Every refusal the HTTP stack makes itself is an OpenAI error JSON; a too-large body's 413 is read by real clients."""

from __future__ import annotations

import http.client
import json

import httpx
import openai
import pytest

from .conftest import assert_openai_error, closed_within, connect, read_answer

MIB = 1 << 20


def ask(port: int, raw: bytes) -> tuple:
    s = connect(port)
    s.sendall(raw)
    a = read_answer(s)
    return a, s


def test_a_request_head_too_large_gets_a_431_json(serve):
    r = serve()
    # A header field larger than any head the router reads (and than hyper's own default limit).
    a, s = ask(r.port, b"GET /v1/models HTTP/1.1\r\nHost: r\r\nX-Big: " + b"a" * (512 * 1024) + b"\r\n\r\n")
    assert_openai_error(a, 431, "header_too_large")
    assert closed_within(s, 10)
    # Too many header fields.
    fields = b"".join(b"X-F%d: v\r\n" % i for i in range(150))
    a, s = ask(r.port, b"GET /v1/models HTTP/1.1\r\nHost: r\r\n" + fields + b"\r\n")
    assert_openai_error(a, 431, "header_too_large")


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /v1/models HTTP/1.1\r\nHost: r\r\nthis is not a header\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 TLS hello to a plain-HTTP port\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: r\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: -1\r\n\r\n",
    ],
    ids=["bad-header-line", "tls-hello", "two-lengths", "negative-length"],
)
def test_a_malformed_request_head_gets_a_400_json(serve, raw):
    r = serve()
    a, s = ask(r.port, raw)
    assert_openai_error(a, 400, "bad_request")
    assert closed_within(s, 10)


def test_a_malformed_head_pipelined_behind_a_good_one_gets_a_400_json(serve):
    r = serve()
    s = connect(r.port)
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: r\r\nno colon here\r\n\r\n")
    first = read_answer(s)
    assert first.status == 200 and first.json()["object"] == "list"
    rest = first.extra
    while b"\r\n\r\n" not in rest:
        chunk = s.recv(65536)
        assert chunk, f"closed before the second answer; got {rest!r}"
        rest += chunk
    head, body = rest.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), rest
    while not body.endswith(b"}}"):
        body += s.recv(65536)
    assert json.loads(body)["error"]["code"] == "bad_request"


def test_a_method_a_known_path_does_not_serve_gets_a_405_json(serve):
    r = serve(admin_token="secret")
    for method, path in [("GET", "/v1/chat/completions"), ("DELETE", "/admin/weights"), ("POST", "/v1/models")]:
        resp = httpx.request(method, f"{r.url}{path}", headers={"authorization": "Bearer secret"}, timeout=10)
        assert resp.status_code == 405, (method, path, resp.text)
        assert resp.headers["content-type"].startswith("application/json")
        assert resp.json()["error"]["code"] == "method_not_allowed"
    # unknown paths were JSON already
    resp = httpx.get(r.url + "/nope", timeout=10)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("order", ["cl-first", "te-first"])
def test_a_request_with_both_content_length_and_transfer_encoding_is_refused(serve, order):
    r = serve()
    body = b'{"prompt": "hi", "max_tokens": 1}'
    cl = b"Content-Length: %d\r\n" % len(body)
    te = b"Transfer-Encoding: chunked\r\n"
    fields = cl + te if order == "cl-first" else te + cl
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    a, s = ask(r.port, b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n" + fields
               + b"\r\n" + chunked)
    assert_openai_error(a, 400, "invalid_framing")
    assert a.headers.get("connection") == "close"
    assert closed_within(s, 10)
    # Transfer-Encoding alone is fine: the request reaches the router (and fails later, for want of a live node).
    a, s = ask(r.port, b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n" + te
               + b"\r\n" + chunked)
    assert a.status != 400 or a.error_code() != "invalid_framing"
    s.close()


def big_body() -> bytes:
    return b'{"messages": [{"role": "user", "content": "' + b"x" * (64 * MIB) + b'"}]}'


def test_a_64_mib_body_gets_a_413_that_http_client_httpx_and_openai_read(serve):
    r = serve()  # max_body_bytes: 16 MiB
    body = big_body()

    conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 413
    assert json.loads(resp.read())["error"]["code"] == "body_too_large"
    conn.close()

    resp2 = httpx.post(r.url + "/v1/chat/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=30)
    assert resp2.status_code == 413 and resp2.json()["error"]["code"] == "body_too_large"

    client = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * (64 * MIB)}])
    assert caught.value.status_code == 413
    assert "body_too_large" in str(caught.value.body) or "exceeds the limit" in str(caught.value)


def test_a_chunked_body_over_the_limit_gets_a_413_too(serve):
    r = serve(max_body_bytes=1024)
    s = connect(r.port)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * 65536
    try:
        for _ in range(256):  # 16 MiB, much more than socket buffers hold
            s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        s.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pytest.fail("the router reset the connection while the client was still sending")
    assert_openai_error(read_answer(s), 413, "body_too_large")
    assert closed_within(s, 10)
    s.close()
