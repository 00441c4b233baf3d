"""The controller's decisions as OpenTelemetry traces: a span per pass with the audit log's
lines as its events, a child span per change carried out; sent over real OTLP/HTTP when the
standard variables name an endpoint."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from controller_harness import (
    Analyzer,
    Backends,
    acting_args,
    haproxy_over,
    held_listener,
    make_controller,
    needs_haproxy,
    port_of,
    recommendation,
    start_command,
    stop_command,
    weights,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from gpubalance.controller import tracing
from gpubalance.controller.audit import AuditLog

pytestmark = needs_haproxy


def _tracer() -> tuple[Any, InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return provider.get_tracer("test"), spans


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    found: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        found.setdefault(span.name, []).append(span)
    return found


def test_a_pass_is_a_span_its_decisions_its_events_and_each_change_a_child(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with Backends(["s1", "s2"]) as backends, Analyzer() as analyzer:
            config = backends.config(tmp_path / "run")
            async with haproxy_over(config) as haproxy, aiohttp.ClientSession() as http:
                analyzer.recommendations = [
                    recommendation("r1", "set_weights", "be", {"weights": {"s1": 60}}),
                    recommendation("r2", "drain", "be/nope"),
                ]
                controller = make_controller(
                    config.socket_path, analyzer.url, http, tmp_path / "audit.jsonl"
                )
                controller.tracer, spans = _tracer()
                report = await controller.run_once()
                assert report.applied and weights(haproxy.api)["s1"] == (60, "ready")

                found = _by_name(spans.get_finished_spans())
                (pass_span,) = found["controller pass"]
                (change,) = found["controller set_weight"]
                assert change.parent is not None
                assert change.parent.span_id == pass_span.context.span_id
                assert change.attributes is not None
                assert change.attributes["gpubalance.target"] == "be/s1"
                assert change.attributes["gpubalance.after"] == 60
                assert change.attributes["gpubalance.recommendation"] == "r1"
                assert pass_span.attributes is not None
                assert pass_span.attributes["gpubalance.pass.applied"] == 1
                assert pass_span.attributes["gpubalance.pass.refused"] == 1
                assert pass_span.attributes["gpubalance.pass.dry_run"] is False
                # every line the pass wrote to the audit log is one of its events, in order
                lines = AuditLog(tmp_path / "audit.jsonl").entries()
                events = [(e.name, dict(e.attributes or {})) for e in pass_span.events]
                assert [name for name, _ in events] == [e["decision"] for e in lines]
                rejected = next(a for name, a in events if name == "rejected")
                assert rejected["gpubalance.recommendation"] == "r2"
                assert "unknown_target" in rejected["gpubalance.reason"]
                applied = next(a for name, a in events if name == "applied")
                assert applied["gpubalance.before"] == 100

                # a pass that cannot read HAProxy is a span with the error
                spans.clear()
                await asyncio.to_thread(haproxy.stop)
                failed = await controller.run_once()
                assert not failed.ok
                (broken,) = spans.get_finished_spans()
                assert broken.status.status_code is StatusCode.ERROR
                assert broken.status.description == failed.error

    asyncio.run(scenario())


def test_the_standard_variables_say_whether_and_where_spans_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    quiet = tracing.from_environment()
    assert quiet.endpoint is None
    with quiet.tracer.start_as_current_span("controller pass") as span:
        assert not span.is_recording()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9/")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")  # set but empty: unset
    sending = tracing.from_environment()
    assert sending.endpoint == "http://127.0.0.1:9/v1/traces"
    sending.shutdown()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.from_environment().endpoint is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.from_environment().endpoint is None


class _Collector:
    """An OTLP/HTTP traces receiver: what a collector on :4318 would be sent."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.port = 0  # the one it listens on, chosen as it binds
        self._runner: web.AppRunner | None = None

    async def _traces(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        self.requests.append(ExportTraceServiceRequest.FromString(await request.read()))
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    async def __aenter__(self) -> _Collector:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    def spans(self) -> list[tuple[dict[str, str], Any]]:
        """(resource attributes, span) of every span received."""
        out = []
        for req in self.requests:
            for rs in req.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                out += [(resource, s) for ss in rs.scope_spans for s in ss.spans]
        return out


def test_the_controller_command_sends_its_decisions_over_otlp(tmp_path: Path) -> None:
    async def scenario(listener: socket.socket) -> None:
        async with (
            Backends(["s1", "s2"]) as backends,
            Analyzer() as analyzer,
            _Collector() as collector,
        ):
            config = backends.config(tmp_path / "run")
            async with haproxy_over(config) as haproxy:
                analyzer.recommendations = [
                    recommendation("r1", "set_weights", "be", {"weights": {"s1": 60}})
                ]
                env = {
                    "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}",
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "",  # the base URL's /v1/traces
                    "OTEL_SERVICE_NAME": "controller-h1",
                }
                port = port_of(listener)
                args = acting_args(analyzer.url, config.socket_path, tmp_path, port)
                process = await start_command(*args, env=env, listener=listener)
                try:
                    async with asyncio.timeout(30):
                        while not analyzer.acks_of("r1"):
                            await asyncio.sleep(0.05)
                finally:
                    err = await stop_command(process)
                assert process.returncode == 0, err.decode()
                assert weights(haproxy.api)["s1"] == (60, "ready")
        # stopping flushed what the batch processor held
        received = collector.spans()
        assert received, err.decode()
        assert {r["service.name"] for r, _ in received} == {"controller-h1"}
        names = [s.name for _, s in received]
        assert "controller pass" in names
        assert names.count("controller set_weight") == 2  # 100 -> 68 -> 60, the default step
        applied = [
            {a.key: a.value for a in e.attributes}
            for _, s in received
            for e in s.events
            if e.name == "applied"
        ]
        assert [a["gpubalance.after"].int_value for a in applied] == [68, 60]
        assert f"127.0.0.1:{collector.port}" in err.decode()  # it says where traces go

    with held_listener() as listener:
        asyncio.run(scenario(listener))
