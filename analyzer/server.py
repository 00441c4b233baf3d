"""Serve the analyzer: each GPU's verdict and the recommendations over HTTP, for people,
dashboards and executors (gpubalance's controller, a Dynamo-style connector, a router).

`gpubalance analyzer --source URL_OR_DIR` pulls the source (an exporter's base URL, a Prometheus
API or a lab run directory) every --interval, judges each GPU over --window windows and serves:

  GET  /api/v1/diagnosis              each GPU and pool now (?history=N: N windows before)
  GET  /api/v1/recommendations        what to change, cheapest first, with the acks so far
  POST /api/v1/recommendations/ID/ack {"status": "accepted|rejected|applied|failed",
                                       "reason": "...", "by": "..."} (bearer token)
  GET  /api/v1/openapi.json           the OpenAPI 3.1 document of all this
  GET  /metrics                       verdicts as Prometheus series, and the analyzer's health
  GET  /healthz                       200 while cycles run, 503 when they stopped

It listens on 127.0.0.1 unless told otherwise, and beyond loopback only with --token-file (a
bearer token for the acks); TLS, basic auth and rate limits of every endpoint come from
--web.config.file, the exporter's (node_exporter's) format. SIGTERM stops it cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.process_collector import ProcessCollector
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from gpubalance import __version__
from gpubalance.analyzer.service import (
    AnalyzerService,
    DiagnosisReport,
    ExpiredRecommendation,
    RecommendationsReport,
    UnknownRecommendation,
)
from gpubalance.diagnosis import STATES, AckStatus, Recommendation
from gpubalance.webconfig import bearer_refusal

if TYPE_CHECKING:
    from gpubalance.analyzer.service import RecommenderLike
    from gpubalance.analyzer.verdict import Classifier

log = logging.getLogger("gpubalance.analyzer")

DEFAULT_LISTEN = "127.0.0.1:9451"  # the exporter's port + 1, on loopback
DEFAULT_WINDOW_SECONDS = 30.0
DEFAULT_INTERVAL_SECONDS = 10.0
MAX_HISTORY = 1000  # windows per GPU one diagnosis answer may carry
MAX_ACK_BYTES = 16 * 1024
STALL_GRACE_SECONDS = 30.0
API = "/api/v1"
TOKEN_SETTING = "--token-file"


class AckBody(BaseModel):
    """An executor's answer to a recommendation."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    status: AckStatus
    reason: str = Field(max_length=2000, description="why, in words for the recommendation's log")
    by: str = Field(min_length=1, max_length=200, description="who answers: an executor's name")


@dataclass(frozen=True, slots=True)
class ErrorBody:
    """What a refused request gets: what was wrong, in words."""

    error: str


@dataclass(frozen=True, slots=True)
class HealthBody:
    """``ok`` while cycles run and the source answers, ``source_down`` while it does not (both
    200: restarting the analyzer cannot fix a source), ``starting`` before the first cycle and
    ``stalled`` when cycles stopped (503)."""

    status: str
    last_cycle_age_seconds: float | None
    source_up: bool | None
    source_error: str | None


_DIAGNOSIS = TypeAdapter(DiagnosisReport)
_RECOMMENDATIONS = TypeAdapter(RecommendationsReport)
_RECOMMENDATION = TypeAdapter(Recommendation)
_ERROR = TypeAdapter(ErrorBody)
_HEALTH = TypeAdapter(HealthBody)
_ACK = TypeAdapter(AckBody)


def _json(adapter: TypeAdapter[Any], value: object, status: int = 200) -> web.Response:
    return web.Response(
        body=adapter.dump_json(value), status=status, content_type="application/json"
    )


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(
        body=_ERROR.dump_json(ErrorBody(message)),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def _ack_problem(error: ValidationError) -> str:
    """A ValidationError as "field: what is wrong" sentences."""
    parts = []
    for item in error.errors(include_url=False):
        where = ".".join(str(part) for part in item["loc"]) or "body"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


class AnalyzerServer:
    """The HTTP side of an :class:`AnalyzerService`. ``token``: the bearer token acks need
    (None: acks are taken from anyone who reaches the port, which is loopback only)."""

    def __init__(
        self, service: AnalyzerService, token: str | None = None, interval_seconds: float = 10.0
    ) -> None:
        self.service = service
        self.token = token
        self.interval_seconds = interval_seconds
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(AnalyzerCollector(service))
        ProcessCollector(namespace="gpubalance_analyzer", registry=self.registry)
        self._last_cycle_done: float | None = None  # monotonic
        self._openapi = json.dumps(openapi_document(token is not None)).encode()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_ACK_BYTES)
        app.router.add_get(f"{API}/diagnosis", self.diagnosis)
        app.router.add_get(f"{API}/recommendations", self.recommendations)
        app.router.add_post(f"{API}/recommendations/{{id}}/ack", self.ack)
        app.router.add_get(f"{API}/openapi.json", self.openapi)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/healthz", self.healthz)
        return app

    async def run_cycles(self) -> None:
        """A cycle every interval, in a worker thread (the source's reads block), until
        cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.to_thread(self.service.cycle)
            self._last_cycle_done = loop.time()
            await asyncio.sleep(max(0.0, self.interval_seconds - (loop.time() - started)))

    # handlers

    async def diagnosis(self, request: web.Request) -> web.Response:
        text = request.query.get("history", "0")
        try:
            history = int(text)
        except ValueError:
            history = -1
        if not 0 <= history <= MAX_HISTORY:
            return _error(400, f"history must be a whole number 0..{MAX_HISTORY}, got {text!r}")
        return _json(_DIAGNOSIS, self.service.diagnosis(history))

    async def recommendations(self, request: web.Request) -> web.Response:
        return _json(_RECOMMENDATIONS, self.service.recommendations())

    async def ack(self, request: web.Request) -> web.Response:
        if self.token is not None:
            refusal = bearer_refusal(
                request.headers.get("Authorization"), self.token, TOKEN_SETTING
            )
            if refusal is not None:
                return _error(
                    401, refusal, {"WWW-Authenticate": 'Bearer realm="gpubalance analyzer"'}
                )
        if request.content_type != "application/json":
            return _error(
                415, f"send the ack as application/json, not {request.content_type or 'nothing'}"
            )
        try:
            body = AckBody.model_validate_json(await request.read())
        except ValidationError as exc:
            return _error(400, _ack_problem(exc))
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"an ack is at most {MAX_ACK_BYTES} bytes")
        try:
            recommendation = self.service.ack(
                request.match_info["id"], body.status, body.reason, body.by
            )
        except UnknownRecommendation as exc:
            return _error(404, str(exc))
        except ExpiredRecommendation as exc:
            return _error(409, str(exc))
        return _json(_RECOMMENDATION, recommendation)

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, request: web.Request) -> web.Response:
        source = self.service.health().source
        age = (
            None
            if self._last_cycle_done is None
            else asyncio.get_running_loop().time() - self._last_cycle_done
        )
        # three intervals, and time for a slow cycle (a source timing out, a big fleet)
        stalled = age is not None and age > 3 * self.interval_seconds + STALL_GRACE_SECONDS
        if age is None:
            status = "starting"
        elif stalled:
            status = "stalled"
        else:
            status = "ok" if source.up else "source_down"
        body = HealthBody(status, None if age is None else round(age, 3), source.up, source.error)
        return _json(_HEALTH, body, 503 if status in ("starting", "stalled") else 200)


# -- /metrics --------------------------------------------------------------------------------


def recommended_weights(
    recommendations: Iterable[Recommendation],
) -> Iterator[tuple[str, str, float]]:
    """(worker, gpu, weight) of the current ``set_weights`` recommendations, surest first: a
    worker's first weight is the one served. Their parameters carry ``weights``, a list of
    ``{"worker": str, "gpu": int | str, "weight": number}``."""
    seen: set[str] = set()
    for recommendation in sorted(recommendations, key=lambda r: -r.confidence):
        if recommendation.action != "set_weights":
            continue
        weights = recommendation.parameters.get("weights")
        if not isinstance(weights, list | tuple):
            continue
        for item in weights:
            if not isinstance(item, Mapping):
                continue
            worker, gpu, weight = item.get("worker"), item.get("gpu"), item.get("weight")
            if not isinstance(worker, str) or worker in seen:
                continue
            if not isinstance(weight, int | float) or isinstance(weight, bool):
                continue
            seen.add(worker)
            yield worker, "" if gpu is None else str(gpu), float(weight)


class AnalyzerCollector:
    """The service's last cycle as metric families, built fresh on each scrape."""

    def __init__(self, service: AnalyzerService) -> None:
        self.service = service

    def collect(self) -> Iterable[Metric]:
        report = self.service.diagnosis()
        state = GaugeMetricFamily(
            "gpubalance_gpu_state",
            "The GPU's verdict over its latest analysis window: 1 for its state (with its "
            "cause), 0 for the others",
            labels=["host", "gpu", "uuid", "state", "cause"],
        )
        confidence = GaugeMetricFamily(
            "gpubalance_gpu_state_confidence",
            "How sure the analyzer is of the GPU's state, 0..1",
            labels=["host", "gpu", "uuid"],
        )
        for verdict in report.gpus:
            ids = [verdict.host, str(verdict.gpu), verdict.uuid]
            for name in STATES:
                current = name == verdict.state
                cause = verdict.cause if current else "none"
                state.add_metric([*ids, name, cause], 1.0 if current else 0.0)
            confidence.add_metric(ids, verdict.confidence)
        idle = GaugeMetricFamily(
            "gpubalance_fleet_idle_while_queued_ratio",
            "Share of the pool's GPU-time in its latest window in which a GPU idled while "
            "another of the pool had work queued; absent when unknown",
            labels=["host", "pool"],
        )
        for fleet in report.fleet:
            if fleet.idle_while_queued_ratio is not None:
                idle.add_metric([fleet.host, fleet.pool], fleet.idle_while_queued_ratio)
        weight = GaugeMetricFamily(
            "gpubalance_worker_recommended_weight",
            "The routing weight the current set_weights recommendation gives the worker (a "
            "router's metric scorer can read it)",
            labels=["worker", "gpu"],
        )
        for worker, gpu, value in recommended_weights(
            self.service.recommendations().recommendations
        ):
            weight.add_metric([worker, gpu], value)
        yield from (state, confidence, idle, weight)
        yield from self._health()

    def _health(self) -> Iterable[Metric]:
        health = self.service.health()
        up = GaugeMetricFamily(
            "gpubalance_analyzer_source_up",
            "1 when the analyzer's last pull of its source worked, else 0",
            labels=["source"],
        )
        if health.source.up is not None:
            up.add_metric([health.source.description], 1.0 if health.source.up else 0.0)
        yield up
        errors = CounterMetricFamily(
            "gpubalance_analyzer_source_errors",
            "Pulls of the source that failed, by reason (unreachable, http_error, bad_answer, "
            "no_data, other)",
            labels=["reason"],
        )
        for reason, count in sorted(health.source_errors.items()):
            errors.add_metric([reason], count)
        yield errors
        failures = CounterMetricFamily(
            "gpubalance_analyzer_cycle_failures",
            "Cycles that failed after the pull, by stage (diagnose, recommend); the log has why",
            labels=["stage"],
        )
        for stage, count in sorted(health.cycle_failures.items()):
            failures.add_metric([stage], count)
        yield failures
        last = health.source.last_success_seconds
        if last is not None:
            yield GaugeMetricFamily(
                "gpubalance_analyzer_last_success_timestamp_seconds",
                "Unix time of the last pull of the source that worked",
                value=last,
            )
        yield SummaryMetricFamily(
            "gpubalance_analyzer_cycle_duration_seconds",
            "Time per cycle: pull, features, verdicts, recommendations",
            count_value=health.cycles,
            sum_value=health.cycle_seconds_total,
        )
        if health.last_cycle_seconds is not None:
            yield GaugeMetricFamily(
                "gpubalance_analyzer_last_cycle_duration_seconds",
                "Time the last cycle took",
                value=health.last_cycle_seconds,
            )


# -- the OpenAPI document --------------------------------------------------------------------


def _closed(schemas: dict[str, Any]) -> dict[str, Any]:
    """Every property of every object is always in the answer, and nothing else is: the
    dataclasses dump every field, defaults included."""
    for schema in schemas.values():
        if "properties" in schema:
            schema["required"] = list(schema["properties"])
            schema["additionalProperties"] = False
    return schemas


def openapi_document(token: bool) -> dict[str, Any]:
    """The OpenAPI 3.1 document of what :meth:`AnalyzerServer.app` serves (``token``: acks
    need a bearer token)."""
    adapters = {
        "diagnosis": ("serialization", _DIAGNOSIS),
        "recommendations": ("serialization", _RECOMMENDATIONS),
        "recommendation": ("serialization", _RECOMMENDATION),
        "error": ("serialization", _ERROR),
        "health": ("serialization", _HEALTH),
        "ack": ("validation", _ACK),  # what a client sends
    }
    keys, everything = TypeAdapter.json_schemas(
        [(name, mode, adapter) for name, (mode, adapter) in adapters.items()],
        ref_template="#/components/schemas/{model}",
    )
    schemas = _closed(everything["$defs"])
    ref = {name: keys[(name, mode)] for name, (mode, _) in adapters.items()}

    def json_content(schema: dict[str, Any], description: str) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": schema}}}

    def error(description: str) -> dict[str, Any]:
        return json_content(ref["error"], description)

    ack: dict[str, Any] = {
        "summary": "Answer a recommendation: accepted, rejected, applied or failed",
        "operationId": "ackRecommendation",
        "parameters": [
            {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
        ],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": ref["ack"]}},
        },
        "responses": {
            "200": json_content(ref["recommendation"], "The recommendation with its acks"),
            "400": error("The body is not an ack; the error says which field and why"),
            "404": error("No recommendation with this id"),
            "409": error("The recommendation has expired"),
            "413": error("The body is too large"),
            "415": error("The body is not application/json"),
        },
    }
    components: dict[str, Any] = {"schemas": schemas}
    if token:
        ack["security"] = [{"bearer": []}]
        ack["responses"]["401"] = error("No bearer token, or the wrong one")
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "gpubalance analyzer",
            "version": __version__,
            "description": "Each GPU starved, overloaded or balanced, why, and what to change.",
        },
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "paths": {
            f"{API}/diagnosis": {
                "get": {
                    "summary": "Each GPU and pool now, and optionally the windows before",
                    "operationId": "getDiagnosis",
                    "parameters": [
                        {
                            "name": "history",
                            "in": "query",
                            "required": False,
                            "description": "windows before now to add, per GPU and per pool",
                            "schema": {"type": "integer", "minimum": 0, "maximum": MAX_HISTORY},
                        }
                    ],
                    "responses": {
                        "200": json_content(ref["diagnosis"], "The last cycle's verdicts"),
                        "400": error("history is not a whole number in range"),
                    },
                }
            },
            f"{API}/recommendations": {
                "get": {
                    "summary": "The recommendations not yet expired, cheapest first",
                    "operationId": "getRecommendations",
                    "responses": {"200": json_content(ref["recommendations"], "With their acks")},
                }
            },
            f"{API}/recommendations/{{id}}/ack": {"post": ack},
            f"{API}/openapi.json": {
                "get": {
                    "summary": "This document",
                    "operationId": "getOpenApi",
                    "responses": {"200": json_content({"type": "object"}, "OpenAPI 3.1")},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Verdicts and the analyzer's health as Prometheus series",
                    "operationId": "getMetrics",
                    "responses": {
                        "200": {
                            "description": "Prometheus text format 0.0.4",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/healthz": {
                "get": {
                    "summary": "Whether cycles run and the source answers",
                    "operationId": "getHealth",
                    "responses": {
                        "200": json_content(ref["health"], "ok or source_down"),
                        "503": json_content(ref["health"], "starting or stalled"),
                    },
                }
            },
        },
        "components": components,
    }


# -- the command -----------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    from gpubalance.analyzer.baselines import CLASSIFIERS
    from gpubalance.arguments import seconds

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--source",
        metavar="URL_OR_DIR",
        help="what to judge: an exporter's base URL (http://HOST:9450), a Prometheus API "
        "(http://HOST:9090, Thanos, Mimir) or a lab run directory",
    )
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"address to serve on (default {DEFAULT_LISTEN}; port 0 picks a free one; beyond "
        "loopback it needs --token-file)",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="file holding the bearer token that POST .../ack needs",
    )
    parser.add_argument(
        "--web.config.file",
        dest="web_config_file",
        metavar="FILE",
        help="TLS, basic auth and rate limit of every endpoint, in the exporter-toolkit "
        "format the exporter reads; reloaded on SIGHUP",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--model",
        metavar="FILE",
        help="a model `gpubalance analyzer train` wrote (skops file); default: the model "
        "gpubalance ships",
    )
    which.add_argument(
        "--classifier", choices=sorted(CLASSIFIERS), help="a rule instead of a model"
    )
    parser.add_argument(
        "--window",
        type=seconds,
        default=DEFAULT_WINDOW_SECONDS,
        metavar="SECONDS",
        help=f"analysis window (default {DEFAULT_WINDOW_SECONDS:.0f} s)",
    )
    parser.add_argument(
        "--interval",
        type=seconds,
        default=DEFAULT_INTERVAL_SECONDS,
        metavar="SECONDS",
        help=f"seconds between pulls of the source (default {DEFAULT_INTERVAL_SECONDS:.0f})",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )


def _classifier(args: argparse.Namespace) -> tuple[Classifier, str]:
    from gpubalance.analyzer import model
    from gpubalance.analyzer.baselines import CLASSIFIERS
    from gpubalance.config import ConfigError

    if args.classifier is not None:
        return CLASSIFIERS[args.classifier](), args.classifier
    if args.model is None:
        try:
            return model.load_shipped(), "model (shipped)"
        except model.ModelError as exc:
            raise ConfigError(str(exc)) from None
    path = Path(args.model)
    try:
        return model.load(path), f"model {path}"
    except model.ModelError as exc:
        raise ConfigError(f"--model {exc}") from None


def run(
    args: argparse.Namespace, make_recommender: Callable[[], RecommenderLike] | None = None
) -> int:
    """`gpubalance analyzer`; ``make_recommender`` makes the service's recommender (default
    :class:`~gpubalance.analyzer.recommend.Recommender`)."""
    from gpubalance.analyzer.recommend import Recommender
    from gpubalance.analyzer.service import OpeningSource
    from gpubalance.analyzer.sources import SourceError, open_source
    from gpubalance.config import LOG_FORMAT, ConfigError, read_token
    from gpubalance.webconfig import WebSecurity, is_loopback, parse_listen

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    try:
        if args.source is None:
            raise ConfigError(
                "--source is needed: an exporter's URL, a Prometheus API or a lab run directory"
            )
        host, port = parse_listen(args.listen)
        token = read_token(args.token_file, TOKEN_SETTING) if args.token_file else None
        if token is None and not is_loopback(host):
            raise ConfigError(
                f"--listen {args.listen} is beyond loopback, where anyone who reaches it could "
                "ack recommendations; give --token-file (and TLS in --web.config.file)"
            )
        security = WebSecurity(args.web_config_file)
        if token is not None and security.config.users:
            raise ConfigError(
                f"--token-file and the basic_auth_users of {args.web_config_file} both want "
                "the Authorization header, so no ack could carry both; use one of them"
            )
        classifier, classifier_name = _classifier(args)
        # a URL may not answer yet (the analyzer starts before its source): found at a pull
        url = args.source.startswith(("http://", "https://"))
        source = OpeningSource(args.source) if url else open_source(args.source)
    except (ConfigError, ValueError, SourceError) as exc:
        print(f"gpubalance analyzer: {exc}", file=sys.stderr)
        return 2
    if not is_loopback(host) and security.config.tls is None:
        log.warning("--listen %s without TLS: the bearer token travels in clear", args.listen)
    service = AnalyzerService(
        source,
        classifier,
        (make_recommender or Recommender)(),
        window_seconds=args.window,
        classifier_name=classifier_name,
    )
    server = AnalyzerServer(service, token, args.interval)
    return asyncio.run(serve(server, host, port, security))


async def serve(server: AnalyzerServer, host: str, port: int, security: Any) -> int:
    """Listen, cycle until SIGTERM or SIGINT, then stop listening and cycling; the exit code."""
    app = server.app()
    security.install(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await security.listen(runner.server, host, port)
    except OSError as exc:
        await runner.cleanup()
        reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        print(f"gpubalance analyzer: cannot listen on {host}:{port}: {reason}", file=sys.stderr)
        return 2
    for url in security.urls():
        log.info("listening on %s", url)
    log.info("source %s, every %g s", server.service.source.description, server.interval_seconds)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    if security.path:
        loop.add_signal_handler(signal.SIGHUP, security.reload_soon)
    cycles = asyncio.create_task(server.run_cycles())
    await stop.wait()
    log.info("stopping")
    cycles.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await cycles
    security.close()
    await runner.cleanup()
    return 0
