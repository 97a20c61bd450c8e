"""The open-loop multi-turn streaming client behind ``ppd-router bench``.

Conversations arrive on a seeded Poisson schedule; each runs its turns in
order against an OpenAI-compatible ``/v1/chat/completions`` endpoint with
``stream: true``. The next turn's history is the previous messages, the answer
actually streamed back and the next user message. Every request is timed
(TTFT, E2E, tokens) and classified (ok, ``http_<status>``, ``timeout``,
``connection_error``, ``malformed_stream``, ``stream_error``; turns never sent
after a failure are ``not_sent``).

One httpx client with an unlimited connection pool carries all streams on one
event loop (uvloop when available); httpx-sse turns the body into events as the
SSE specification has it (a multi-line ``data:`` event is one event, its lines
joined by newlines), and each event's data is decoded once with ``orjson``
(see ``bench/results/bench-client.md`` for what the client itself costs).
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import httpx
import orjson
from httpx_aiohttp import AiohttpTransport
from httpx_sse import SSEError, aconnect_sse

from ppd_router import count_tokens
from ppd_router.bench.arrivals import poisson_arrivals
from ppd_router.bench.metrics import NOT_SENT, RequestRecord, percentile, summarize
from ppd_router.bench.workloads import Conversation, Workload
from ppd_router.errors import ConfigError, TargetError

CHAT_PATH = "/v1/chat/completions"


def chat_url(target: str) -> str:
    """Normalise ``http://host:port[/v1][/chat/completions]`` to the chat completions URL."""
    parts = urlsplit(target.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TargetError(f"--target must be an http(s) URL with a host, got {target!r}")
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as e:
        raise TargetError(f"--target has a bad port: {target!r}") from e
    path = parts.path.rstrip("/")
    if path.endswith("/chat/completions"):
        pass
    elif path.endswith("/v1"):
        path += "/chat/completions"
    else:
        path += CHAT_PATH
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def models_url(chat: str) -> str:
    return chat[: -len("/chat/completions")] + "/models"


@dataclass
class BenchConfig:
    """Everything one run needs; ``model`` None means ask ``/v1/models``."""

    target: str
    workload: Workload
    qps: float
    duration: float
    timeout: float = 30.0
    seed: int = 0
    think_time: float = 0.0
    model: Optional[str] = None
    api_key: Optional[str] = None
    session_header: bool = True

    def validate(self) -> None:
        for name, v in (("qps", self.qps), ("duration", self.duration), ("timeout", self.timeout)):
            if not v > 0:
                raise ConfigError(f"--{name} must be positive, got {v:g}")
        if self.think_time < 0:
            raise ConfigError(f"--think-time must be >= 0, got {self.think_time:g}")
        chat_url(self.target)


@dataclass
class RunState:
    """Live counters, read by the progress display while the run goes on."""

    t0: float = 0.0
    scheduled: int = 0
    arrived: int = 0
    conversations_done: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    chunks: int = 0
    records: list[RequestRecord] = field(default_factory=list)
    arrival_lag: list[float] = field(default_factory=list)
    loop_lag: list[float] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0 if self.t0 else 0.0


@dataclass
class BenchResult:
    records: list[RequestRecord]
    duration: float
    summary: dict[str, Any]


@dataclass
class _Stream:
    text_parts: list[str] = field(default_factory=list)
    ttft: Optional[float] = None
    completion_tokens: Optional[int] = None
    prompt_tokens: Optional[int] = None
    done: bool = False
    error: Optional[str] = None  # "malformed_stream" / "stream_error"


def parse_event(data: str, st: _Stream, now: float) -> None:
    """Apply one SSE event's data (its ``data:`` lines joined) to the stream state."""
    if data == "[DONE]":
        st.done = True
        return
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        st.error = "malformed_stream"
        return
    if not isinstance(obj, dict):
        st.error = "malformed_stream"
        return
    if "error" in obj:
        st.error = "stream_error"
        return
    choices = obj.get("choices")
    if isinstance(choices, list) and choices:
        delta = choices[0].get("delta") if isinstance(choices[0], dict) else None
        content = delta.get("content") if isinstance(delta, dict) else None
        if content:
            if st.ttft is None:
                st.ttft = now
            st.text_parts.append(content)
    elif choices is None and not obj.get("usage"):
        st.error = "malformed_stream"
        return
    usage = obj.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("completion_tokens"), int):
            st.completion_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            st.prompt_tokens = usage["prompt_tokens"]


def request_body(model: str, messages: list[dict[str, str]], n_out: int) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "messages": messages,
            "max_tokens": n_out,
            "stream": True,
            "stream_options": {"include_usage": True},
            # vLLM's extension: generate exactly max_tokens, so outputs match the workload.
            "ignore_eos": True,
        }
    )


async def _stream_once(
    http: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    body: bytes,
    rec: RequestRecord,
    state: RunState,
    t_start: float,
) -> _Stream:
    st = _Stream()
    async with aconnect_sse(http, "POST", url, content=body, headers=headers) as source:
        resp = source.response
        rec.status = resp.status_code
        rec.path = resp.headers.get("x-ppd-path")
        if resp.status_code != 200:
            await resp.aread()
            st.error = f"http_{resp.status_code}"
            return st
        async for event in source.aiter_sse():
            state.chunks += 1
            parse_event(event.data, st, time.perf_counter() - t_start)
            if st.done or st.error:
                break
    if st.error is None and not st.done:
        st.error = "malformed_stream"  # the stream ended without [DONE]
    if st.error is None and st.ttft is None:
        st.error = "malformed_stream"  # finished without any content
    return st


async def run_request(
    http: httpx.AsyncClient,
    cfg: BenchConfig,
    model: str,
    url: str,
    messages: list[dict[str, str]],
    n_out: int,
    conv_id: str,
    rec: RequestRecord,
    state: RunState,
) -> Optional[str]:
    """Send one turn, fill ``rec`` and return the streamed answer (None on failure)."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if cfg.session_header:
        headers["X-Session-ID"] = conv_id
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    body = request_body(model, messages, n_out)
    t_start = time.perf_counter()
    rec.start = t_start - state.t0
    state.in_flight += 1
    state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
    try:
        st = await asyncio.wait_for(_stream_once(http, url, headers, body, rec, state, t_start), cfg.timeout)
    except asyncio.TimeoutError:  # the request's deadline (the clients themselves have no timeouts)
        rec.reason = "timeout"
        return None
    except SSEError:  # a 200 answer that is not text/event-stream
        rec.reason = "malformed_stream"
        return None
    except aiohttp.ClientResponseError as e:  # a malformed status line or header (httpx-aiohttp passes it on)
        rec.reason = f"http_{e.status}" if e.status else "malformed_stream"
        return None
    except (httpx.TransportError, aiohttp.ClientError, OSError):
        # Refused, reset, or closed before the answer ended. httpx-aiohttp names some of these
        # httpx timeouts (ConnectTimeout for any aiohttp connection error), which they are not here.
        rec.reason = "connection_error"
        return None
    finally:
        state.in_flight -= 1
    rec.e2e = time.perf_counter() - t_start
    if st.error is not None:
        rec.reason = st.error
        return None
    text = "".join(st.text_parts)
    rec.ttft = st.ttft
    rec.prompt_tokens = st.prompt_tokens
    rec.usage_reported = st.completion_tokens is not None
    # Without a usage chunk, fall back to the emulator's word rule on the text.
    rec.completion_tokens = st.completion_tokens if st.completion_tokens is not None else count_tokens(text)
    rec.ok = True
    return text


async def run_conversation(
    http: httpx.AsyncClient,
    cfg: BenchConfig,
    model: str,
    url: str,
    conv: Conversation,
    index: int,
    state: RunState,
) -> None:
    messages: list[dict[str, str]] = []
    if conv.system is not None:
        messages.append({"role": "system", "content": conv.system})
    try:
        for k, turn in enumerate(conv.turns):
            if k > 0 and cfg.think_time > 0:
                await asyncio.sleep(cfg.think_time)
            messages.append({"role": "user", "content": turn.text})
            rec = RequestRecord(conversation=index, turn=k + 1)
            state.records.append(rec)
            answer = await run_request(http, cfg, model, url, messages, turn.n_out, conv.id, rec, state)
            if answer is None:
                for j in range(k + 1, len(conv.turns)):
                    state.records.append(RequestRecord(index, j + 1, reason=NOT_SENT))
                return
            messages.append({"role": "assistant", "content": answer})
    finally:
        state.conversations_done += 1


async def discover_model(http: httpx.AsyncClient, url: str, cfg: BenchConfig) -> str:
    """The first model id served at ``/v1/models``; fails clearly when unreachable."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    try:
        r = await http.get(models_url(url), headers=headers, timeout=min(cfg.timeout, 10))
    except (httpx.HTTPError, OSError) as e:
        raise TargetError(f"cannot reach {models_url(url)}: {e or type(e).__name__}") from e
    if r.status_code != 200:
        raise TargetError(f"{models_url(url)} answered HTTP {r.status_code}; give --model")
    try:
        data = orjson.loads(r.content)
    except orjson.JSONDecodeError as e:
        raise TargetError(f"{models_url(url)} did not answer JSON; give --model") from e
    try:
        return str(data["data"][0]["id"])
    except (KeyError, IndexError, TypeError) as e:
        raise TargetError(f"{models_url(url)} lists no model; give --model") from e


def bench_http_client() -> httpx.AsyncClient:
    """httpx's API over aiohttp's connection pool (httpx-aiohttp): httpcore's own pool costs
    hundreds of milliseconds of TTFT at a few hundred concurrent streams, aiohttp's does not.
    No pool limit, no client timeout (each request has its own deadline), no proxy from the
    environment: the benchmark talks to --target directly."""
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
        timeout=aiohttp.ClientTimeout(None),
        auto_decompress=False,
        trust_env=False,
    )
    return httpx.AsyncClient(transport=AiohttpTransport(client=session), timeout=None, trust_env=False)


async def _probe_loop_lag(state: RunState, interval: float = 0.02) -> None:
    """How late the event loop wakes a sleeper: the client's own queueing delay."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(interval)
        state.loop_lag.append(max(0.0, time.perf_counter() - t - interval))


def _raise_fd_limit() -> None:
    # Hundreds of concurrent streams need a socket each; lift the soft limit to the hard one.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
        except (ValueError, OSError):
            pass


async def run_bench(
    cfg: BenchConfig,
    state: Optional[RunState] = None,
    on_start: Optional[Callable[[RunState], Awaitable[None]]] = None,
) -> BenchResult:
    """Run the whole schedule, wait for every conversation, and summarise."""
    cfg.validate()
    url = chat_url(cfg.target)
    state = state or RunState()
    arrivals = poisson_arrivals(cfg.qps, cfg.duration, cfg.seed)
    state.scheduled = len(arrivals)
    _raise_fd_limit()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    async with bench_http_client() as http:
        model = cfg.model or await discover_model(http, url, cfg)
        ui = asyncio.ensure_future(on_start(state)) if on_start else None
        probe = asyncio.ensure_future(_probe_loop_lag(state))
        tasks: list[asyncio.Task[None]] = []
        state.t0 = time.perf_counter()
        for i, at in enumerate(arrivals):
            delay = at - (time.perf_counter() - state.t0)
            if delay > 0:
                await asyncio.sleep(delay)
            state.arrival_lag.append(max(0.0, (time.perf_counter() - state.t0) - at))
            state.arrived += 1
            conv = cfg.workload.conversation(i)
            tasks.append(asyncio.ensure_future(run_conversation(http, cfg, model, url, conv, i, state)))
        if tasks:
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - state.t0
        probe.cancel()
        if ui is not None:
            ui.cancel()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    summary = summarize(state.records, max(duration, 1e-9))
    lag = percentile(state.arrival_lag, 99)
    loop50, loop99 = percentile(state.loop_lag, 50), percentile(state.loop_lag, 99)
    summary["client"] = {
        "cpu_seconds": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
        "sse_events": state.chunks,
        "peak_concurrent_requests": state.peak_in_flight,
        "arrival_lag_p99_ms": None if lag is None else lag * 1000.0,
        "loop_lag_p50_ms": None if loop50 is None else loop50 * 1000.0,
        "loop_lag_p99_ms": None if loop99 is None else loop99 * 1000.0,
    }
    summary["run"] = {
        "target": url,
        "model": model,
        "qps": cfg.qps,
        "duration": cfg.duration,
        "timeout": cfg.timeout,
        "seed": cfg.seed,
        "think_time": cfg.think_time,
        "conversations": len(arrivals),
        **cfg.workload.info(),
    }
    return BenchResult(state.records, duration, summary)


def run(cfg: BenchConfig, **kw: Any) -> BenchResult:
    """Run on uvloop when installed (the faster loop), else asyncio's default."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.run(run_bench(cfg, **kw))
    return uvloop.run(run_bench(cfg, **kw))
