"""OpenTelemetry traces of the controller's decisions: a span per pass, a span per change it
carries out, and every audit-log line as an event of the span it was decided in.

Traces leave the process only when the standard OpenTelemetry variables ask for them:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the whole URL, e.g. ``http://collector:4318/v1/traces``)
or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the base URL; ``/v1/traces`` is appended), sent as OTLP
over HTTP (protobuf) with the SDK's other ``OTEL_EXPORTER_OTLP_*`` settings (headers, timeout,
TLS certificate). ``OTEL_TRACES_EXPORTER=none`` or ``OTEL_SDK_DISABLED=true`` turn them off.
Without any of these the tracer is OpenTelemetry's no-op one, and a pass costs nothing extra.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

NAME = "gpubalance.controller"
_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


@dataclass(slots=True)
class Tracing:
    """The tracer the controller's parts take, and what flushes it at exit."""

    tracer: trace.Tracer
    endpoint: str | None = None  # where spans go; None: nowhere
    _provider: Any = None

    def shutdown(self) -> None:
        """Send the spans still buffered (bounded by the exporter's timeout)."""
        if self._provider is not None:
            self._provider.shutdown()


def from_environment() -> Tracing:
    """OTLP/HTTP traces where the standard variables ask for them, else the no-op tracer."""
    env = os.environ
    traces, base = (env.get(k, "").strip() for k in _ENDPOINTS)
    # the exporter is given the URL itself: a variable set but empty counts as unset
    endpoint = traces or (base.rstrip("/") + "/v1/traces" if base else None)
    disabled = env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")}
    if endpoint is None or disabled or "otlp" not in exporters:
        return Tracing(trace.NoOpTracer())
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, when set, win over these
    ours = Resource.create({"service.name": NAME, "host.name": socket.gethostname()})
    resource = ours.merge(OTELResourceDetector().detect())
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return Tracing(provider.get_tracer(NAME), endpoint, provider)


def attributes(fields: Mapping[str, object], prefix: str = "gpubalance.") -> dict[str, Any]:
    """Span attributes of an audit line's fields: scalars as they are, anything else as text,
    None left out (OpenTelemetry attributes cannot be None)."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if value is None:
            continue
        if not isinstance(value, str | bool | int | float):
            value = str(value)
        out[prefix + key] = value
    return out


def event(decision: str, fields: Mapping[str, object]) -> None:
    """The audit line as an event of the span it was decided in (none outside a span)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event(decision, attributes(fields))
