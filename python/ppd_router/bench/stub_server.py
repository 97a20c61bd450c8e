"""A minimal OpenAI-compatible streaming server for testing and calibrating the bench client.

It answers ``/v1/models`` and streaming ``/v1/chat/completions`` in vLLM's SSE
shape (a role chunk, one chunk per token, a finish chunk, a usage chunk,
``[DONE]``), generating exactly ``max_tokens`` one-word tokens after a fixed
TTFT delay and a fixed inter-token interval. A ``behaviour`` hook lets a test
make chosen requests fail (HTTP error, hang, malformed or cut-off stream) and
choose the ``x-ppd-path`` header, as the router would send it. It does no model
work, so against it the client's own overhead is what is measured.

Run standalone: ``python -m ppd_router.bench.stub_server --port 8100 --itl-ms 50``.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import orjson
from aiohttp import web
from multidict import CIMultiDict

# What to do with one request: "ok", "http_500" (any http_<code>), "hang",
# "malformed" (a non-JSON event), "no_done" (stream ends without [DONE]),
# "drop" (connection closed mid-stream), "no_usage" (no usage chunk),
# "multiline" (each event's JSON split over two ``data:`` lines, as SSE allows).
Behaviour = Callable[[dict[str, Any], "web.Request"], str]
PathRule = Callable[[dict[str, Any], "web.Request"], Optional[str]]


def user_turn(body: dict[str, Any]) -> int:
    """Turn number of a chat request: its count of user messages."""
    msgs = body.get("messages", ())
    return sum(1 for m in msgs if isinstance(m, dict) and m.get("role") == "user")


def default_path(body: dict[str, Any], request: web.Request) -> Optional[str]:
    return "pd" if user_turn(body) <= 1 else "local"


@dataclass
class SeenRequest:
    """A request as the stub received it, for tests to check what the client sent."""

    headers: Mapping[str, str]  # case-insensitive, as HTTP header names are
    body: dict[str, Any]
    behaviour: str
    path: Optional[str]


@dataclass
class StubConfig:
    ttft_s: float = 0.01
    itl_s: float = 0.0
    model: str = "stub-model"
    behaviour: Optional[Behaviour] = None
    path_rule: Optional[PathRule] = default_path
    record: bool = False  # keep every request in ``seen`` (tests)
    seen: list[SeenRequest] = field(default_factory=list)


_TOKEN = " tok"  # one token under the word rule


def _chunk(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _multiline(event: bytes) -> bytes:
    """The same event with its data over two ``data:`` lines, split after the JSON's first comma:
    a reader joins them with a newline, which JSON takes as whitespace."""
    head, sep, tail = event.partition(b",")
    return head + sep + b"\ndata: " + tail if sep else event


def make_app(cfg: StubConfig) -> web.Application:
    base = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": cfg.model}
    role = _chunk(
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    )
    token = _chunk({**base, "choices": [{"index": 0, "delta": {"content": _TOKEN}, "finish_reason": None}]})
    finish = _chunk({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": cfg.model, "object": "model"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        what = cfg.behaviour(body, request) if cfg.behaviour else "ok"
        path = cfg.path_rule(body, request) if cfg.path_rule else None
        if cfg.record:
            cfg.seen.append(SeenRequest(CIMultiDict(request.headers), body, what, path))
        headers = {"x-ppd-path": path} if path else {}
        if what.startswith("http_"):
            return web.json_response({"error": {"message": "injected failure"}}, status=int(what[5:]), headers=headers)
        n = int(body.get("max_tokens") or 16)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await resp.prepare(request)
        event: Callable[[bytes], bytes] = _multiline if what == "multiline" else bytes
        await resp.write(event(role))
        if what == "hang":
            await asyncio.sleep(3600)  # cancelled when the client gives up
        if cfg.ttft_s > 0:
            await asyncio.sleep(cfg.ttft_s)
        if what == "malformed":
            await resp.write(b"data: {not json\n\n")
            return resp
        for i in range(n):
            if i and cfg.itl_s > 0:
                await asyncio.sleep(cfg.itl_s)
            await resp.write(event(token))
            if what == "drop" and i == n // 2:
                assert request.transport is not None
                request.transport.close()  # the client sees the body cut short
                return resp
        await resp.write(event(finish))
        n_prompt = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", ()))
        if (body.get("stream_options") or {}).get("include_usage") and what != "no_usage":
            await resp.write(
                event(
                    _chunk(
                        {
                            **base,
                            "choices": [],
                            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n},
                        }
                    )
                )
            )
        if what != "no_done":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


class StubServer:
    """The stub on 127.0.0.1 in a background thread with its own event loop.

    ``with StubServer(cfg) as s: ... s.url ...`` starts it on a free port and
    stops it (cancelling hanging handlers) on exit.
    """

    def __init__(self, cfg: StubConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.cfg, self.host, self.port = cfg, host, port
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._runner: Optional[web.AppRunner] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _start(self) -> None:
        # handler_cancellation: a handler stops when its client disconnects (timeouts).
        self._runner = web.AppRunner(
            make_app(self.cfg), handler_cancellation=True, shutdown_timeout=0.5, access_log=None
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.port = sock.getsockname()[1]

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as e:  # noqa: BLE001 - reported to the starting thread
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        assert self._runner is not None
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def start(self) -> StubServer:
        self._thread = threading.Thread(target=self._main, name="stub-server", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> StubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description="Minimal OpenAI-compatible streaming stub server.", allow_abbrev=False)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--ttft-ms", type=float, default=10.0)
    ap.add_argument("--itl-ms", type=float, default=0.0, help="inter-token interval")
    args = ap.parse_args()
    cfg = StubConfig(ttft_s=args.ttft_ms / 1000, itl_s=args.itl_ms / 1000)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    print(
        f"stub server on http://{args.host}:{args.port} (ttft {args.ttft_ms:g} ms, itl {args.itl_ms:g} ms)", flush=True
    )
    t = time.time()
    web.run_app(make_app(cfg), host=args.host, port=args.port, access_log=None, handler_cancellation=True, print=None)
    print(f"stopped after {time.time() - t:.1f} s")


if __name__ == "__main__":
    main()
