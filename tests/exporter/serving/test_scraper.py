"""The scraper reads a serving endpoint's whole /metrics body over real HTTP: a large exposition
in small, slow writes is read to its end; a body past the size limit, one cut off by the server
and one slower than the scrape timeout are errors with their reason, never a partial read."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from aiohttp import web

from gpubalance.exporter.collectors.serving.base import MAX_EXPOSITION_BYTES
from gpubalance.exporter.collectors.serving.formats import read
from gpubalance.exporter.collectors.serving.scraper import ServingScraper
from gpubalance.exporter.collectors.serving.store import ServingStore, SourceStatus
from gpubalance.exporter.config import ServingConfig, ServingEndpoint

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def vllm_exposition(engines: int) -> str:
    """vLLM's gauges and queue-time histogram for ``engines`` data-parallel engines."""
    bounds = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0)
    gauges, histogram = [], []
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        gauges.append(f"# TYPE vllm:{name} gauge\n")
        for e in range(engines):
            gauges.append(f'vllm:{name}{{engine="{e}",model_name="llama-70b"}} {e % 7}.0\n')
    name = "vllm:request_queue_time_seconds"
    histogram.append(f"# TYPE {name} histogram\n")
    for e in range(engines):
        labels = f'engine="{e}",model_name="llama-70b"'
        for i, le in enumerate((*bounds, "+Inf")):
            histogram.append(f'{name}_bucket{{{labels},le="{le}"}} {i}.0\n')
        histogram.append(f"{name}_count{{{labels}}} {len(bounds)}.0\n")
        histogram.append(f"{name}_sum{{{labels}}} {e}.25\n")
    return "".join(gauges + histogram)


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[str]:
    """A real aiohttp server answering /metrics with ``handler``; yields the URL."""
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/metrics"
    finally:
        await runner.cleanup()


async def scrape(url: str, timeout: float) -> tuple[ServingStore, SourceStatus]:
    store = ServingStore()
    endpoint = ServingEndpoint(url=url, format="vllm", worker="w")
    await ServingScraper(ServingConfig(timeout=timeout, endpoints=[endpoint]), store).scrape_once()
    (status,) = store.statuses()
    return store, status


def chunked(body: bytes, size: int, pause: float) -> Handler:
    """Writes ``body`` in ``size``-byte writes, ``pause`` seconds apart, without a length."""

    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain; version=0.0.4"})
        await response.prepare(request)
        for start in range(0, len(body), size):
            await response.write(body[start : start + size])
            await asyncio.sleep(pause)
        await response.write_eof()
        return response

    return handle


def test_a_large_exposition_in_small_slow_writes_is_read_whole() -> None:
    text = vllm_exposition(engines=88)
    assert len(text) > 150_000

    async def run() -> tuple[ServingStore, SourceStatus]:
        async with serving(chunked(text.encode(), 1024, 0.002)) as url:
            return await scrape(url, timeout=60.0)

    store, status = asyncio.run(run())
    assert (status.up, status.error, dict(status.errors_total)) == (True, None, {})
    readings = sorted((s.reading for s in store.readings()), key=lambda r: r.key)
    assert readings == read("vllm", text)
    assert len(readings) == 88
    # the last engine's series come from the body's last writes
    last = next(r for r in readings if r.rank == 87)
    assert (last.queue_depth, last.batch_assembly_delay_seconds_sum) == (3.0, 87.25)


def test_a_body_past_the_limit_is_too_large() -> None:
    lines = b"# TYPE m gauge\n" + b"m 1\n" * (MAX_EXPOSITION_BYTES // 4 + 1)
    assert len(lines) > MAX_EXPOSITION_BYTES

    async def run() -> tuple[ServingStore, SourceStatus]:
        async with serving(chunked(lines, 64 * 1024, 0)) as url:
            return await scrape(url, timeout=60.0)

    store, status = asyncio.run(run())
    assert not status.up and dict(status.errors_total) == {"too_large": 1}
    assert status.error == f"body larger than {MAX_EXPOSITION_BYTES} bytes"
    assert len(store) == 0


def test_a_declared_length_past_the_limit_is_refused_before_reading() -> None:
    """The server says 9 MiB and then stalls: refusing on the header answers at once, where
    reading the body would wait out the minute of timeout."""

    async def run() -> tuple[ServingStore, SourceStatus]:
        release = asyncio.Event()

        async def handle(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse()
            response.content_length = 9 * 1024 * 1024
            await response.prepare(request)
            await response.write(b"# TYPE m gauge\nm 1\n")
            await release.wait()
            return response

        try:
            async with serving(handle) as url:
                return await scrape(url, timeout=60.0)
        finally:
            release.set()

    store, status = asyncio.run(run())
    assert dict(status.errors_total) == {"too_large": 1}
    assert status.error == (
        f"Content-Length {9 * 1024 * 1024} bytes, larger than {MAX_EXPOSITION_BYTES}"
    )
    assert len(store) == 0


def test_a_body_slower_than_the_timeout_is_a_timeout_not_a_partial_read() -> None:
    """Half the exposition arrives, cut on a line boundary, then the server stalls."""
    text = vllm_exposition(engines=8)
    half = text[: text.index("\n", len(text) // 2) + 1].encode()
    assert read("vllm", half.decode())  # what a partial read would have accepted

    async def run() -> tuple[ServingStore, SourceStatus]:
        release = asyncio.Event()

        async def handle(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(half)
            await release.wait()
            return response

        try:
            async with serving(handle) as url:
                return await scrape(url, timeout=0.5)
        finally:
            release.set()

    store, status = asyncio.run(run())
    assert not status.up and dict(status.errors_total) == {"timeout": 1}
    assert status.error == "no whole answer within 0.5 s"
    assert len(store) == 0


def test_a_body_the_server_cuts_off_is_truncated_not_a_partial_read() -> None:
    """The server fails after half its chunked body: the missing last chunk shows it."""
    text = vllm_exposition(engines=8)
    half = text[: text.index("\n", len(text) // 2) + 1].encode()

    async def run() -> tuple[ServingStore, SourceStatus]:
        async def handle(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(half)
            raise ConnectionResetError("gone mid-body")

        async with serving(handle) as url:
            return await scrape(url, timeout=30.0)

    store, status = asyncio.run(run())
    assert not status.up and dict(status.errors_total) == {"truncated": 1}
    assert status.error is not None and status.error.startswith("body cut off: ")
    assert len(store) == 0
