"""HTTP endpoints of the exporter: /metrics, /healthz, /api/v1/snapshot.

Every handler serves the sampler's latest published view; rendered bodies are cached per view
generation and naming profile, so N scrapers cost one render per sample, and no NVML call.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from gpubalance.exporter.collectors.serving.collector import ServingCollector
from gpubalance.exporter.config import ExporterConfig
from gpubalance.exporter.exposition.profiles import PROFILES, render
from gpubalance.exporter.sampler import Sampler
from gpubalance.snapshot import SCHEMA, Snapshot, to_json

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

INDEX = """<!doctype html>
<html><head><title>gpubalance exporter</title></head><body>
<h1>gpubalance exporter</h1>
<ul>
<li><a href="/metrics">/metrics</a> (Prometheus; <code>?names=native|dcgm|both</code>)</li>
<li><a href="/api/v1/snapshot">/api/v1/snapshot</a> (JSON; <code>?history=N</code>)</li>
<li><a href="/healthz">/healthz</a></li>
<li>OTLP/HTTP pushes: on the OTLP listener (<code>exporter.serving.otlp.listen</code>)</li>
</ul></body></html>
"""


class ExporterServer:
    def __init__(self, sampler: Sampler, config: ExporterConfig) -> None:
        self.sampler = sampler
        self.config = config
        self._cache: dict[str, tuple[int, bytes]] = {}
        self.serving = next(
            (c for c in sampler.collectors if isinstance(c, ServingCollector)), None
        )
        self.otlp_url: str | None = None  # where the OTLP listener runs, once it does

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self.index)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/api/v1/snapshot", self.snapshot)
        app.router.add_post("/v1/metrics", self.otlp_elsewhere)
        if self.serving is not None:
            app.cleanup_ctx.append(self._scrape_serving)
        return app

    async def _scrape_serving(self, app: web.Application) -> AsyncIterator[None]:
        assert self.serving is not None
        task = asyncio.create_task(self.serving.scraper.run())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def _cached(self, key: str, generation: int, make: Callable[[], bytes]) -> bytes:
        hit = self._cache.get(key)
        if hit is not None and hit[0] == generation:
            return hit[1]
        body = make()
        self._cache[key] = (generation, body)
        return body

    async def index(self, request: web.Request) -> web.Response:
        return web.Response(text=INDEX, content_type="text/html")

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        view = self.sampler.view
        if view is None:
            return web.Response(status=503, text="no sample taken yet; retry in a second\n")
        profile = request.query.get("names", self.config.names)
        if profile not in PROFILES:
            return web.Response(
                status=400, text=f"names must be one of {', '.join(PROFILES)}, got {profile!r}\n"
            )
        body = self._cached(f"metrics:{profile}", view.generation, lambda: render(view, profile))
        response = web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            response.enable_compression()
        return response

    async def snapshot(self, request: web.Request) -> web.StreamResponse:
        view = self.sampler.view
        if view is None:
            return web.Response(status=503, text="no sample taken yet; retry in a second\n")
        try:
            history = int(request.query.get("history", "0"))
        except ValueError:
            return web.Response(status=400, text="history must be a whole number of samples\n")
        if not 0 <= history <= self.config.history_length:
            return web.Response(
                status=400, text=f"history must be 0..{self.config.history_length}\n"
            )

        def make() -> bytes:
            earlier = tuple(self.sampler.history)[:-1][-history:] if history else ()
            return to_json(
                Snapshot(
                    schema=SCHEMA,
                    interval_seconds=view.interval_seconds,
                    window_seconds=view.window_seconds,
                    trend_window_seconds=view.trend_window_seconds,
                    sample=view.sample,
                    window=view.window,
                    history=earlier,
                )
            )

        body = make() if history else self._cached("snapshot", view.generation, make)
        response = web.Response(body=body, content_type="application/json")
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            response.enable_compression()
        return response

    async def otlp_elsewhere(self, request: web.Request) -> web.Response:
        # the scrape port stays read-only: whoever can scrape must not forge queue figures
        where = self.otlp_url or "not running (exporter.serving.otlp.enabled, --collector.serving)"
        return web.Response(
            status=404,
            text=f"OTLP pushes go to the OTLP listener (exporter.serving.otlp.listen), not the"
            f" scrape port; here it is {where}\n",
        )

    async def healthz(self, request: web.Request) -> web.Response:
        """ok (200), degraded (200: what is wrong under ``problems``), stale or starting (503).

        Only a sampler that stopped publishing answers 503: restarting the exporter can fix
        that, while a lost or stuck GPU or a driver that is away is the host's fault, and an
        exporter taken out of service or restarted over it would stop serving the very
        series that report it (alert on those instead).
        """
        view = self.sampler.view
        if view is None:
            return web.json_response({"status": "starting"}, status=503)
        sample = view.sample
        age = time.time() - sample.timestamp_seconds
        fresh = age <= max(3 * self.config.interval, 5.0)
        nvml_down = not sample.nvml.up and any(r.name == "gpu" for r in sample.collectors)
        problems = [f"NVML down: {sample.nvml.error}"] if nvml_down else []
        problems += [f"GPU {g.index} ({g.uuid}) lost" for g in sample.gpus if g.lost]
        problems += [
            f"GPU {g.index} ({g.uuid}) stale: stuck in {g.stale_call or 'its first call'}"
            for g in sample.gpus
            if g.stale and not g.lost
        ]
        problems += [
            f"collector {r.name} failed: {r.error}"
            for r in sample.collectors
            if not r.success and not (r.name == "gpu" and nvml_down)
        ]
        status = "stale" if not fresh else "degraded" if problems else "ok"
        return web.json_response(
            {
                "status": status,
                "problems": problems,
                "last_sample_age_seconds": round(age, 3),
                "nvml_up": sample.nvml.up,
                "nvml_error": sample.nvml.error,
                "gpus_lost": [g.index for g in sample.gpus if g.lost],
                "gpus_stale": [g.index for g in sample.gpus if g.stale],
                "collectors": {r.name: r.success for r in sample.collectors},
            },
            status=200 if fresh else 503,
        )
