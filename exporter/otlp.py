"""OTLP/HTTP metrics receiver: custom serving workers push their queues to ``POST /v1/metrics``.

A worker that no scrape adapter understands reports through OpenTelemetry instead (see
:mod:`gpubalance.instrument`). The receiver turns five well-known metrics into
:class:`ServingReading` records in the shared :class:`ServingStore`, one stored series per
(worker, class, tenant, GPU):

- ``gpubalance.queue.depth``: Gauge or UpDownCounter (non-monotonic Sum) -> queue_depth
- ``gpubalance.batch.assembly_delay``: Histogram in seconds -> batch_assembly_delay_seconds_*
- ``gpubalance.batch.size``: Histogram -> batch_size_sum, batch_size_count
- ``gpubalance.request.duration``: Histogram in seconds -> request_duration_seconds_*
- ``gpubalance.memory.allocation_failures``: Counter (monotonic Sum) -> allocation_failures_total

Other metrics are ignored. Attributes come from the data point, else the resource:
``service.instance.id`` (the worker; "unknown" when missing), ``gpubalance.class``,
``gpubalance.tenant``, ``gpu.uuid`` and ``gpu.index``.

The store keeps cumulative sums: a CUMULATIVE push replaces what is stored, a DELTA push adds
to it. Points of one push that land in the same series (streams that differ only in attributes
we drop) are summed, after keeping the latest point of each stream, so a collector that batches
two exports of one SDK does not double-count.

The request is hostile until proven otherwise: the body is read incrementally up to a limit,
before and after gzip; decoding (the costly part, bounded by the body size) runs in a worker
thread with a bounded number at a time, so a 4 MiB body never stalls /metrics; at most
``max_points_per_request`` points are looked at. JSON is walked by hand rather than through
protobuf's ``json_format``, which needs about 100 s for a hostile 4 MiB body.
"""

from __future__ import annotations

import asyncio
import binascii
import itertools
import json
import logging
import math
import re
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from gpubalance.exporter.collectors.serving.base import ServingReading
from gpubalance.exporter.collectors.serving.store import (
    SeriesLimitReached,
    ServingStore,
    StoredReading,
)

log = logging.getLogger(__name__)

SOURCE = "otlp"
ENDPOINT = "otlp"  # the store's endpoint (and status) key for every pushed series
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
MAX_GPU_INDEX = 1023  # NVML enumerates a few dozen GPUs per host; more is a mistake

# Attribute keys (point first, else resource) and what they become.
WORKER = "service.instance.id"
GPU_UUID = "gpu.uuid"
GPU_INDEX = "gpu.index"
SERVICE_CLASS = "gpubalance.class"
TENANT = "gpubalance.tenant"
UNKNOWN_WORKER = "unknown"

# OTLP's AggregationTemporality and DataPointFlags values.
DELTA, CUMULATIVE = 1, 2
NO_RECORDED_VALUE = 1

# Units a seconds histogram may arrive in, to seconds; other languages' SDKs often use ms.
SECONDS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
HISTOGRAMS = frozenset({"histogram", "exponential_histogram"})


@dataclass(frozen=True, slots=True)
class OtlpLimits:
    """What one request may carry; past a limit the request or the offending points are refused."""

    max_body_bytes: int = 4 * 1024 * 1024  # compressed and decompressed, like the collector's
    max_points_per_request: int = 10_000  # points past it are rejected (too_many_points)
    max_attributes: int = 128  # per point, resource, array or kvlist
    max_attribute_value_length: int = 256  # of the attributes we keep (worker, class, ...)
    max_values_per_attribute: int = 1000  # distinct tenants (workers, ...) over stored series
    max_any_value_depth: int = 8  # a scalar is 1, an array of scalars 2
    # bodies decoded at once; a hostile 4 MiB body holds up to ~170 MB while it decodes
    max_concurrent_decodes: int = 2


@dataclass(frozen=True, slots=True)
class OtlpStats:
    """Counters since start, for the exporter's self-metrics."""

    requests: Mapping[str, int]  # outcome (accepted, partial, or a refusal reason) -> count
    accepted_points: int
    rejected_points: Mapping[str, int]  # reason -> points refused (partial success)
    ignored_points: Mapping[str, int]  # reason -> points not for us (unknown_metric, ...)


@dataclass(frozen=True, slots=True)
class OtlpReply:
    """An HTTP answer: status, body and its content type."""

    status: int
    body: bytes
    content_type: str
    outcome: str  # accepted, partial, or the refusal's reason (as counted in stats().requests)


class _Refused(Exception):
    """The whole request is refused: HTTP ``status`` with a counted ``reason``."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


class _Rejected(Exception):
    """One point (or every point under one resource) is refused for ``reason``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _malformed(detail: str) -> _Refused:
    return _Refused(400, "malformed", detail)


def _show(value: object) -> str:
    """A sender's value for a message: short, and repr() escapes what UTF-8 cannot carry."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# -- what a request says, in plain values, the same for protobuf and JSON -------------------


@dataclass(frozen=True, slots=True)
class _KvList:
    """A kvlist AnyValue as a hashable value (an array becomes a tuple)."""

    items: tuple[tuple[str, object], ...]


Attributes = dict[str, object]


@dataclass(slots=True)
class _Point:
    attributes: Attributes | _Rejected
    time_unix_nano: int
    flags: int
    value: float | None = None  # Gauge and Sum
    sum: float | None = None  # histograms
    count: int = 0


@dataclass(slots=True)
class _Metric:
    """One metric of a known name, with at most the request's budget of points."""

    name: str
    kind: str  # gauge, sum, histogram, exponential_histogram, summary or "" (no data)
    monotonic: bool
    temporality: int
    unit: str
    resource: Attributes | _Rejected
    scope: str
    points: list[_Point]
    over_budget: int  # points past max_points_per_request, not decoded


@dataclass
class _Tally:
    """Budgets and counts of a walk through one request."""

    budget: int  # points still to decode
    entries: int  # resource, scope and metric entries still to visit
    ignored: Counter[str] = field(default_factory=Counter)

    def visit(self, n: int) -> None:
        """Account for ``n`` entries before iterating them: ~1M empty ones cost seconds."""
        self.entries -= n
        if self.entries < 0:
            raise _Refused(
                413,
                "too_many_metrics",
                "more resources, scopes and metrics in one request than max_points_per_request;"
                " send smaller batches",
            )


def _check_width(n: int, limits: OtlpLimits) -> None:
    if n > limits.max_attributes:
        raise _Rejected("too_many_attributes", f"{n} attributes, more than {limits.max_attributes}")


def _check_depth(depth: int, limits: OtlpLimits) -> None:
    if depth > limits.max_any_value_depth:
        raise _Rejected(
            "attribute_too_deep", f"an attribute nests deeper than {limits.max_any_value_depth}"
        )


# -- protobuf ----------------------------------------------------------------------------------


def _pb_value(value: Any, depth: int, limits: OtlpLimits) -> object:
    _check_depth(depth, limits)
    kind = value.WhichOneof("value")
    if kind == "array_value":
        items = value.array_value.values
        _check_width(len(items), limits)
        return tuple(_pb_value(v, depth + 1, limits) for v in items)
    if kind == "kvlist_value":
        pairs = value.kvlist_value.values
        _check_width(len(pairs), limits)
        return _KvList(tuple((kv.key, _pb_value(kv.value, depth + 1, limits)) for kv in pairs))
    return None if kind is None else getattr(value, kind)


def _pb_attributes(kvs: Sequence[Any], limits: OtlpLimits) -> Attributes | _Rejected:
    try:
        _check_width(len(kvs), limits)
        return {kv.key: _pb_value(kv.value, 1, limits) for kv in kvs}
    except _Rejected as rejected:
        return rejected


def _pb_point(kind: str, p: Any, limits: OtlpLimits) -> _Point:
    point = _Point(_pb_attributes(p.attributes, limits), p.time_unix_nano, p.flags)
    if kind in ("gauge", "sum"):
        which = p.WhichOneof("value")
        point.value = None if which is None else float(getattr(p, which))
    elif kind in HISTOGRAMS:
        point.count = p.count
        point.sum = p.sum if p.HasField("sum") else None
    return point


def _pb_metrics(body: bytes, limits: OtlpLimits, tally: _Tally) -> Iterator[_Metric]:
    try:
        request = ExportMetricsServiceRequest.FromString(body)
    except DecodeError as exc:
        raise _malformed(f"not an ExportMetricsServiceRequest: {exc}") from None
    tally.visit(len(request.resource_metrics))
    for rm in request.resource_metrics:
        resource: Attributes | _Rejected | None = None  # decoded when a known metric needs it
        tally.visit(len(rm.scope_metrics))
        for sm in rm.scope_metrics:
            tally.visit(len(sm.metrics))
            for m in sm.metrics:
                kind = m.WhichOneof("data") or ""
                data = getattr(m, kind) if kind else None
                points = data.data_points if data is not None else ()
                if m.name not in _SPECS:
                    tally.ignored["unknown_metric"] += len(points)
                    continue
                if resource is None:
                    resource = _pb_attributes(rm.resource.attributes, limits)
                take = min(len(points), tally.budget)
                tally.budget -= take
                yield _Metric(
                    name=m.name,
                    kind=kind,
                    monotonic=kind == "sum" and m.sum.is_monotonic,
                    temporality=getattr(data, "aggregation_temporality", 0),
                    unit=m.unit,
                    resource=resource,
                    scope=sm.scope.name,
                    points=[_pb_point(kind, p, limits) for p in points[:take]],
                    over_budget=len(points) - take,
                )


# -- JSON: OTLP's protobuf JSON mapping, walked by hand --------------------------------------

_JSON_KINDS = {
    "gauge": "gauge",
    "sum": "sum",
    "histogram": "histogram",
    "exponentialHistogram": "exponential_histogram",
    "summary": "summary",
}
_TEMPORALITIES = {
    "AGGREGATION_TEMPORALITY_UNSPECIFIED": 0,
    "AGGREGATION_TEMPORALITY_DELTA": DELTA,
    "AGGREGATION_TEMPORALITY_CUMULATIVE": CUMULATIVE,
}
_INTEGER = re.compile(r"-?[0-9]{1,20}")  # bounded: int() refuses 4300 digits with ValueError
_GPU_INDEX = re.compile(r"\s*[0-9]{1,4}\s*")


@cache
def _snake(name: str) -> str:
    return re.sub("([A-Z])", r"_\1", name).lower()


def _get(obj: Mapping[str, Any], name: str) -> Any:
    """A field by its lowerCamelCase JSON name, or the proto name the collector also accepts."""
    value = obj.get(name)
    return obj.get(_snake(name)) if value is None else value


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _malformed(f"{where} must be an object, not {type(value).__name__}")
    return value


def _list(obj: Mapping[str, Any], name: str, where: str) -> list[Any]:
    value = _get(obj, name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise _malformed(f"{where}.{name} must be a list, not {type(value).__name__}")
    return value


def _text(obj: Mapping[str, Any], name: str, where: str) -> str:
    value = _get(obj, name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _malformed(f"{where}.{name} must be a string, not {type(value).__name__}")
    return value


def _int(value: Any, where: str) -> int:
    """An int64/uint64 field: a JSON number or a decimal string, within 64 bits."""
    if value is None:
        return 0
    integral = (
        (isinstance(value, int) and not isinstance(value, bool))
        or (isinstance(value, float) and value.is_integer())
        or (isinstance(value, str) and _INTEGER.fullmatch(value) is not None)
    )
    if integral and -(2**63) <= int(value) < 2**64:
        return int(value)
    raise _malformed(f"{where} must be a 64-bit integer, not {_show(value)}")


def _unsigned(obj: Mapping[str, Any], name: str, where: str) -> int:
    value = _int(_get(obj, name), f"{where}.{name}")
    if value < 0:
        raise _malformed(f"{where}.{name} must not be negative")
    return value


def _double(value: Any, where: str) -> float:
    """A double field: a JSON number, or a string ("NaN", "Infinity", "1.5")."""
    try:
        if isinstance(value, int | float | str) and not isinstance(value, bool):
            return float(value)
    except (ValueError, OverflowError):
        pass
    raise _malformed(f"{where} must be a number, not {_show(value)}")


def _json_value(value: Any, depth: int, limits: OtlpLimits, where: str) -> object:
    _check_depth(depth, limits)
    value = _object(value, where)
    if (s := _get(value, "stringValue")) is not None:
        if isinstance(s, str):
            return s
    elif (b := _get(value, "boolValue")) is not None:
        if isinstance(b, bool):
            return b
    elif (i := _get(value, "intValue")) is not None:
        return _int(i, where)
    elif (d := _get(value, "doubleValue")) is not None:
        return _double(d, where)
    elif (raw := _get(value, "bytesValue")) is not None:
        if isinstance(raw, str):
            try:
                return binascii.a2b_base64(raw)
            except ValueError:
                pass
    elif (array := _get(value, "arrayValue")) is not None:
        items = _list(_object(array, where), "values", where)
        _check_width(len(items), limits)
        return tuple(_json_value(v, depth + 1, limits, where) for v in items)
    elif (kvlist := _get(value, "kvlistValue")) is not None:
        pairs = _list(_object(kvlist, where), "values", where)
        _check_width(len(pairs), limits)
        return _KvList(tuple(_json_pair(kv, depth + 1, limits, where) for kv in pairs))
    else:
        return None
    raise _malformed(f"{where}: an AnyValue of the wrong type: {_show(value)}")


def _json_pair(kv: Any, depth: int, limits: OtlpLimits, where: str) -> tuple[str, object]:
    kv = _object(kv, where)
    key = _get(kv, "key")
    if not isinstance(key, str):
        raise _malformed(f"{where}: an attribute key must be a string, not {_show(key)}")
    return key, _json_value(_get(kv, "value"), depth, limits, f"{where}[{_show(key)}]")


def _json_attributes(
    obj: Mapping[str, Any], limits: OtlpLimits, where: str
) -> Attributes | _Rejected:
    kvs = _list(obj, "attributes", where)
    try:
        _check_width(len(kvs), limits)
        return dict(_json_pair(kv, 1, limits, f"{where}.attributes") for kv in kvs)
    except _Rejected as rejected:
        return rejected


def _json_point(kind: str, p: Any, limits: OtlpLimits, where: str) -> _Point:
    p = _object(p, where)
    point = _Point(
        _json_attributes(p, limits, where),
        _unsigned(p, "timeUnixNano", where),
        _unsigned(p, "flags", where),
    )
    if kind in ("gauge", "sum"):
        if (d := _get(p, "asDouble")) is not None:
            point.value = _double(d, f"{where}.asDouble")
        elif (i := _get(p, "asInt")) is not None:
            point.value = float(_int(i, f"{where}.asInt"))
    elif kind in HISTOGRAMS:
        point.count = _unsigned(p, "count", where)
        if (s := _get(p, "sum")) is not None:
            point.sum = _double(s, f"{where}.sum")
    return point


def _json_temporality(data: Mapping[str, Any], where: str) -> int:
    value = _get(data, "aggregationTemporality")
    if isinstance(value, str) and value in _TEMPORALITIES:
        return _TEMPORALITIES[value]
    return _int(value, f"{where}.aggregationTemporality")


def _json_metrics(body: bytes, limits: OtlpLimits, tally: _Tally) -> Iterator[_Metric]:
    try:
        root = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _malformed(f"not JSON: {exc}") from None
    if not isinstance(root, dict):
        raise _malformed("the body must be a JSON object (an ExportMetricsServiceRequest)")
    resource_metrics = _list(root, "resourceMetrics", "request")
    tally.visit(len(resource_metrics))
    for r, rm in enumerate(resource_metrics):
        rw = f"resourceMetrics[{r}]"
        rm = _object(rm, rw)
        resource: Attributes | _Rejected | None = None
        scope_metrics = _list(rm, "scopeMetrics", rw)
        tally.visit(len(scope_metrics))
        for s, sm in enumerate(scope_metrics):
            sw = f"{rw}.scopeMetrics[{s}]"
            sm = _object(sm, sw)
            scope = _text(_object(_get(sm, "scope"), sw), "name", f"{sw}.scope")
            metrics = _list(sm, "metrics", sw)
            tally.visit(len(metrics))
            for i, m in enumerate(metrics):
                mw = f"{sw}.metrics[{i}]"
                m = _object(m, mw)
                kind, data = "", {}
                for json_name, name in _JSON_KINDS.items():
                    if (found := _get(m, json_name)) is not None:
                        kind, data = name, _object(found, f"{mw}.{json_name}")
                        break
                points = _list(data, "dataPoints", mw)
                name = _text(m, "name", mw)
                if name not in _SPECS:
                    tally.ignored["unknown_metric"] += len(points)
                    continue
                if resource is None:
                    resource = _json_attributes(_object(_get(rm, "resource"), rw), limits, rw)
                take = min(len(points), tally.budget)
                tally.budget -= take
                monotonic = _get(data, "isMonotonic") or False
                if not isinstance(monotonic, bool):
                    raise _malformed(f"{mw}.sum.isMonotonic must be true or false")
                yield _Metric(
                    name=name,
                    kind=kind,
                    monotonic=kind == "sum" and monotonic,
                    temporality=_json_temporality(data, mw) if kind != "gauge" else 0,
                    unit=_text(m, "unit", mw),
                    resource=resource,
                    scope=scope,
                    points=[
                        _json_point(kind, p, limits, f"{mw}.dataPoints[{j}]")
                        for j, p in enumerate(points[:take])
                    ],
                    over_budget=len(points) - take,
                )


# -- from points to series ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Spec:
    kinds: frozenset[str]  # gauge, updown (non-monotonic Sum), counter (monotonic Sum), histogram
    fields: tuple[str, ...]  # ServingReading fields: (value,) or (sum, count)
    seconds: bool = False  # a duration histogram: the unit is converted to seconds


_SPECS = {
    "gpubalance.queue.depth": _Spec(frozenset({"gauge", "updown"}), ("queue_depth",)),
    "gpubalance.batch.assembly_delay": _Spec(
        frozenset({"histogram"}),
        ("batch_assembly_delay_seconds_sum", "batch_assembly_delay_seconds_count"),
        seconds=True,
    ),
    "gpubalance.batch.size": _Spec(
        frozenset({"histogram"}), ("batch_size_sum", "batch_size_count")
    ),
    "gpubalance.request.duration": _Spec(
        frozenset({"histogram"}),
        ("request_duration_seconds_sum", "request_duration_seconds_count"),
        seconds=True,
    ),
    "gpubalance.memory.allocation_failures": _Spec(
        frozenset({"counter"}), ("allocation_failures_total",)
    ),
}


@dataclass(frozen=True, slots=True)
class _Series:
    """What one stored OTLP series is per: (worker, class, tenant, GPU)."""

    worker: str
    service_class: str | None
    tenant: str | None
    gpu_uuid: str | None
    gpu_index: int | None

    def labels(self) -> tuple[tuple[str, object], ...]:
        return (
            ("worker", self.worker),
            ("class", self.service_class),
            ("tenant", self.tenant),
            ("gpu_uuid", self.gpu_uuid),
            ("gpu_index", self.gpu_index),
        )

    def reading(self) -> ServingReading:
        """An empty reading of this series, for its first push."""
        return ServingReading(
            key=self.key,
            gpu_uuid=self.gpu_uuid,
            service_class=self.service_class,
            tenant=self.tenant,
        )

    @property
    def key(self) -> str:
        """ServingReading.key, e.g. "worker=w1,class=chat,gpu_index=0" (absent parts left out)."""
        return ",".join(f"{k}={_escape(str(v))}" for k, v in self.labels() if v is not None)


def _escape(value: str) -> str:
    # keeps the key unambiguous when a value holds the separators
    return value.replace("%", "%25").replace(",", "%2C").replace("=", "%3D")


def _label(key: str, value: object, limits: OtlpLimits) -> str | None:
    """A string attribute we keep: worker, class, tenant, GPU UUID ("" means absent)."""
    if value is None or value == "":
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise _Rejected("bad_attribute", f"{key} must be a string, not {_show(value)}")
    if len(value) > limits.max_attribute_value_length:
        raise _Rejected(
            "attribute_too_long",
            f"{key} is {len(value)} characters, more than {limits.max_attribute_value_length}",
        )
    if not value.isprintable():
        raise _Rejected("bad_attribute", f"{key} holds unprintable characters: {_show(value)}")
    return value


def _gpu_index(value: object) -> int | None:
    """gpu.index: an int, or digits (OTEL_RESOURCE_ATTRIBUTES makes every value a string)."""
    if value is None or value == "":
        return None
    if isinstance(value, str) and _GPU_INDEX.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_GPU_INDEX:
        raise _Rejected(
            "bad_attribute", f"gpu.index must be 0..{MAX_GPU_INDEX}, not {_show(value)}"
        )
    return value


def _series(attributes: Attributes, resource: Attributes, limits: OtlpLimits) -> _Series:
    def pick(key: str) -> object:
        return attributes[key] if key in attributes else resource.get(key)

    return _Series(
        worker=_label(WORKER, pick(WORKER), limits) or UNKNOWN_WORKER,
        service_class=_label(SERVICE_CLASS, pick(SERVICE_CLASS), limits),
        tenant=_label(TENANT, pick(TENANT), limits),
        gpu_uuid=_label(GPU_UUID, pick(GPU_UUID), limits),
        gpu_index=_gpu_index(pick(GPU_INDEX)),
    )


def _identity(attributes: Attributes) -> tuple[tuple[str, object], ...]:
    return tuple(sorted(attributes.items(), key=lambda kv: kv[0]))


@dataclass(slots=True)
class _Group:
    """One metric's points for one series in one request, ready to merge with the store."""

    fields: tuple[str, ...]
    latest: dict[tuple[object, ...], tuple[tuple[int, int], tuple[float, ...]]] = field(
        default_factory=dict
    )  # stream -> ((time, order), values): replacing points (Gauge, CUMULATIVE)
    delta: list[float] | None = None  # the sum of DELTA points
    points: int = 0


@dataclass
class _Batch:
    """A decoded request: what to merge into the store, and what was refused or ignored."""

    groups: dict[tuple[_Series, str], _Group] = field(default_factory=dict)
    rejected: Counter[str] = field(default_factory=Counter)
    ignored: Counter[str] = field(default_factory=Counter)
    details: dict[str, str] = field(default_factory=dict)  # reason -> first detail

    def reject(self, reason: str, detail: str, points: int = 1) -> None:
        if points:
            self.rejected[reason] += points
            self.details.setdefault(reason, detail)


def _instrument(metric: _Metric) -> str:
    if metric.kind == "sum":
        return "counter" if metric.monotonic else "updown"
    return "histogram" if metric.kind in HISTOGRAMS else metric.kind


def _point_values(metric: _Metric, spec: _Spec, point: _Point, delta: bool) -> tuple[float, ...]:
    """The fields a point carries, in base units; raises _Rejected for impossible values."""
    where = metric.name
    if len(spec.fields) == 1:
        value = point.value
        if value is None or not math.isfinite(value):
            raise _Rejected("invalid_value", f"{where}: value {value} is not a finite number")
        # an UpDownCounter's delta may be negative; the stored depth is checked after the merge
        if value < 0 and not (delta and _instrument(metric) == "updown"):
            raise _Rejected("invalid_value", f"{where}: value {value} is negative")
        return (value,)
    total = point.sum
    if total is None:
        if point.count:
            raise _Rejected("invalid_value", f"{where}: a histogram point without a sum")
        total = 0.0
    if not math.isfinite(total) or total < 0:
        raise _Rejected("invalid_value", f"{where}: histogram sum {total} is not finite and >= 0")
    if spec.seconds:
        total *= SECONDS[metric.unit]
    return (total, float(point.count))


def _metric_refusal(metric: _Metric, spec: _Spec) -> _Rejected | None:
    """Why none of a metric's points can be used, if so."""
    instrument = _instrument(metric)
    if instrument not in spec.kinds:
        kinds = "/".join(sorted(spec.kinds))
        return _Rejected(
            "wrong_type", f"{metric.name} must be {kinds}, not {instrument or 'empty'}"
        )
    if metric.kind != "gauge" and metric.temporality not in (DELTA, CUMULATIVE):
        return _Rejected(
            "bad_temporality", f"{metric.name}: temporality {metric.temporality} is not 1 or 2"
        )
    if spec.seconds and metric.unit not in SECONDS:
        return _Rejected("wrong_unit", f"{metric.name} must be in s, not {_show(metric.unit)}")
    if isinstance(metric.resource, _Rejected):
        return _Rejected(metric.resource.reason, f"resource: {metric.resource.detail}")
    return None


def _add_metric(batch: _Batch, metric: _Metric, limits: OtlpLimits, order: Iterator[int]) -> None:
    spec = _SPECS[metric.name]
    batch.reject(
        "too_many_points",
        f"more than {limits.max_points_per_request} in one request",
        metric.over_budget,
    )
    refusal = _metric_refusal(metric, spec)
    if refusal is not None:
        batch.reject(refusal.reason, refusal.detail, len(metric.points))
        return
    assert isinstance(metric.resource, dict)  # a refused resource was handled above
    delta = metric.kind != "gauge" and metric.temporality == DELTA
    resource_id = _identity(metric.resource)
    for point in metric.points:
        if point.flags & NO_RECORDED_VALUE:  # a staleness marker: nothing to store
            batch.ignored["no_recorded_value"] += 1
            continue
        try:
            if isinstance(point.attributes, _Rejected):
                raise point.attributes
            series = _series(point.attributes, metric.resource, limits)
            values = _point_values(metric, spec, point, delta)
        except _Rejected as rejected:
            batch.reject(rejected.reason, rejected.detail)
            continue
        group = batch.groups.setdefault((series, metric.name), _Group(spec.fields))
        group.points += 1
        if delta:
            previous = group.delta or [0.0] * len(values)
            group.delta = [a + b for a, b in zip(previous, values, strict=True)]
        else:
            stream = (resource_id, metric.scope, _identity(point.attributes))
            stamp = (point.time_unix_nano, next(order))
            if stream not in group.latest or group.latest[stream][0] < stamp:
                group.latest[stream] = (stamp, values)


def decode(
    body: bytes, content_type: str, content_encoding: str = "", limits: OtlpLimits = OtlpLimits()
) -> _Batch:
    """Turn one request body into what to store; pure, so it can run in a worker thread.

    ``content_encoding`` is "gzip" when the body is still compressed. Raises _Refused.
    """
    if content_encoding == "gzip":
        body = _gunzip(body, limits.max_body_bytes)
    tally = _Tally(budget=limits.max_points_per_request, entries=limits.max_points_per_request)
    walk = _pb_metrics if content_type == PROTOBUF else _json_metrics
    batch = _Batch()
    order = itertools.count()
    for metric in walk(body, limits, tally):
        _add_metric(batch, metric, limits, order)
    batch.ignored.update(tally.ignored)
    return batch


def _gunzip(data: bytes, limit: int) -> bytes:
    """Decompress gzip member by member, stopping one byte past ``limit`` (a gzip bomb)."""
    out = bytearray()
    try:
        while data:
            member = zlib.decompressobj(wbits=zlib.MAX_WBITS | 16)
            out += member.decompress(data, limit + 1 - len(out))
            if len(out) > limit:
                raise _Refused(
                    413, "decompressed_too_large", f"the body inflates past {limit} bytes"
                )
            if not member.eof:
                raise _Refused(400, "bad_compression", "the gzip body is truncated")
            data = member.unused_data
    except zlib.error as exc:
        raise _Refused(400, "bad_compression", f"the body is not gzip: {exc}") from None
    return bytes(out)


# -- the receiver ----------------------------------------------------------------------------


class OtlpReceiver:
    """Serves OTLP/HTTP ``POST /v1/metrics`` (protobuf or JSON, optionally gzip) into a store."""

    def __init__(
        self,
        store: ServingStore,
        limits: OtlpLimits = OtlpLimits(),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.limits = limits
        self.clock = clock
        self._decoding = asyncio.Semaphore(limits.max_concurrent_decodes)
        self._counting = threading.Lock()  # stats() is read from the sampler's thread
        self._requests: Counter[str] = Counter()
        self._accepted = 0
        self._rejected: Counter[str] = Counter()
        self._ignored: Counter[str] = Counter()
        # attribute -> values over stored OTLP series; a superset once the store drops some
        self._values: dict[str, set[object]] = {}

    def stats(self) -> OtlpStats:
        with self._counting:
            return OtlpStats(
                requests=dict(self._requests),
                accepted_points=self._accepted,
                rejected_points=dict(self._rejected),
                ignored_points=dict(self._ignored),
            )

    async def handle(self, request: web.Request) -> web.Response:
        """The aiohttp handler for ``POST /v1/metrics``."""
        started = time.perf_counter()
        content_type = request.content_type
        try:
            try:
                encoding = self._check_headers(content_type, request.headers)
                async with self._decoding:
                    body, inflated = await self._read(request)
                    batch = await asyncio.get_running_loop().run_in_executor(
                        None,
                        decode,
                        body,
                        content_type,
                        "" if inflated else encoding,
                        self.limits,
                    )
            except _Refused as refused:
                reply = self._refuse(refused, content_type, started)
            else:
                reply = self._store(batch, content_type, started)
        except Exception:  # a bug must cost one request, not the exporter; the fuzzer hunts them
            log.exception("OTLP receiver failed on a request")
            reply = self._refuse(
                _Refused(500, "internal_error", "the receiver failed; see the exporter's log"),
                content_type,
                started,
            )
        return web.Response(status=reply.status, body=reply.body, content_type=reply.content_type)

    def process(self, body: bytes, content_type: str, content_encoding: str = "") -> OtlpReply:
        """handle() without HTTP, on a body already read: for the fuzzer and benches."""
        started = time.perf_counter()
        try:
            encoding = self._check_headers(content_type, {"Content-Encoding": content_encoding})
            if len(body) > self.limits.max_body_bytes:
                raise _Refused(
                    413, "too_large", f"the body exceeds {self.limits.max_body_bytes} bytes"
                )
            batch = decode(body, content_type, encoding, self.limits)
        except _Refused as refused:
            return self._refuse(refused, content_type, started)
        return self._store(batch, content_type, started)

    @staticmethod
    def _check_headers(content_type: str, headers: Mapping[str, str]) -> str:
        if content_type not in (PROTOBUF, JSON):
            raise _Refused(
                415,
                "unsupported_media_type",
                f"Content-Type must be {PROTOBUF} or {JSON}, not {_show(content_type)}",
            )
        encoding = headers.get("Content-Encoding", "").strip().lower()
        if encoding not in ("", "identity", "gzip"):
            raise _Refused(
                415,
                "unsupported_encoding",
                f"Content-Encoding must be gzip or absent, not {_show(encoding)}",
            )
        return "gzip" if encoding == "gzip" else ""

    async def _read(self, request: web.Request) -> tuple[bytes, bool]:
        """The body, never more than the limit in memory; and whether aiohttp inflated it."""
        limit = self.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _Refused(413, "too_large", f"the body exceeds {limit} bytes")
        stream = request.content
        body = bytearray()
        try:
            async for chunk in stream.iter_chunked(64 * 1024):
                body += chunk
                # set when the server inflates gzip itself (aiohttp's default), chunk by chunk
                compressed = stream.total_compressed_bytes
                if compressed is not None and compressed > limit:
                    raise _Refused(413, "too_large", f"the body exceeds {limit} bytes")
                if len(body) > limit:
                    if compressed is None:
                        raise _Refused(413, "too_large", f"the body exceeds {limit} bytes")
                    raise _Refused(
                        413, "decompressed_too_large", f"the body inflates past {limit} bytes"
                    )
        except web.RequestPayloadError as exc:  # aiohttp could not inflate it
            raise _Refused(400, "bad_compression", f"the body could not be read: {exc}") from None
        return bytes(body), stream.total_compressed_bytes is not None

    def _refuse(self, refused: _Refused, content_type: str, started: float) -> OtlpReply:
        with self._counting:
            self._requests[refused.reason] += 1
        status = self.store.status(SOURCE, ENDPOINT)
        with self.store.lock():
            status.last_attempt_seconds = self.clock()
            status.duration_seconds = time.perf_counter() - started
            status.error = refused.message
            status.errors_total[refused.reason] += 1
        return _encode(
            Status(message=refused.message), refused.status, content_type, refused.reason
        )

    def _store(self, batch: _Batch, content_type: str, started: float) -> OtlpReply:
        now = self.clock()
        accepted = self._apply(batch, now)
        rejected = sum(batch.rejected.values())
        outcome = "partial" if rejected else "accepted"
        with self._counting:
            self._requests[outcome] += 1
            self._accepted += accepted
            self._rejected.update(batch.rejected)
            self._ignored.update(batch.ignored)
        response = ExportMetricsServiceResponse()
        message = None
        if rejected:
            message = f"rejected {rejected} of {accepted + rejected} points: " + "; ".join(
                f"{reason} {n} ({batch.details[reason]})"
                for reason, n in batch.rejected.most_common()
            )
            response.partial_success.rejected_data_points = rejected
            response.partial_success.error_message = message
        status = self.store.status(SOURCE, ENDPOINT)
        with self.store.lock():
            status.up = True
            status.last_attempt_seconds = status.last_success_seconds = now
            status.duration_seconds = time.perf_counter() - started
            status.error = message
            status.errors_total.update(batch.rejected)
        return _encode(response, 200, content_type, outcome)

    def _apply(self, batch: _Batch, now: float) -> int:
        """Merge the batch into the store, series by series; returns the points accepted."""
        by_series: dict[_Series, list[tuple[str, _Group]]] = {}
        for (series, name), group in batch.groups.items():
            by_series.setdefault(series, []).append((name, group))
        accepted = 0
        recounted = False
        for series, groups in by_series.items():
            stored = self.store.get(SOURCE, ENDPOINT, series.worker, series.key)
            reading = stored.reading if stored is not None else series.reading()
            changes, points = _changes(batch, groups, reading)
            if not changes:
                continue
            if stored is None and (full := self._full_attribute(series)) is not None:
                if not recounted:  # once per request: it walks every stored series
                    self._recount_values()
                    recounted = True
                    full = self._full_attribute(series)
                if full is not None:
                    limit = self.limits.max_values_per_attribute
                    batch.reject("attribute_cardinality", f"{full} has {limit} values", points)
                    continue
            try:
                self.store.put(
                    StoredReading(
                        SOURCE,
                        series.worker,
                        ENDPOINT,
                        replace(reading, **changes),
                        now,
                        series.gpu_index,
                    )
                )
            except SeriesLimitReached as exc:
                batch.reject("series_limit", str(exc), points)
                continue
            if stored is None:
                self._count_values(series)
            accepted += points
        return accepted

    def _full_attribute(self, series: _Series) -> str | None:
        """The attribute a new series would take past max_values_per_attribute, if any."""
        for key, value in series.labels():
            seen = self._values.get(key, ())
            if (
                value is not None
                and value not in seen
                and len(seen) >= self.limits.max_values_per_attribute
            ):
                return key
        return None

    def _count_values(self, series: _Series) -> None:
        for key, value in series.labels():
            if value is not None:
                self._values.setdefault(key, set()).add(value)

    def _recount_values(self) -> None:
        # the store may have dropped series since their values were counted
        self._values = {}
        for stored in self.store.readings():
            if stored.source == SOURCE:
                r = stored.reading
                self._count_values(
                    _Series(stored.worker, r.service_class, r.tenant, r.gpu_uuid, stored.gpu_index)
                )


def _changes(
    batch: _Batch, groups: list[tuple[str, _Group]], reading: ServingReading
) -> tuple[dict[str, float], int]:
    """The fields a series takes from this push, and the points they come from; a metric whose
    stored total would become impossible (a DELTA depth below zero) is rejected."""
    changes: dict[str, float] = {}
    points = 0
    for name, group in groups:
        values = _merge(group, reading)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            batch.reject("invalid_value", f"{name}: the total would be {values}", group.points)
            continue
        changes.update(zip(group.fields, values, strict=True))
        points += group.points
    return changes, points


def _merge(group: _Group, reading: ServingReading) -> tuple[float, ...]:
    """The group's fields after this push: replaced by the latest of each stream (summed over
    streams), else the stored totals; plus the DELTA points."""
    if group.latest:
        values = [sum(v[i] for _, v in group.latest.values()) for i in range(len(group.fields))]
    else:
        values = [getattr(reading, f) or 0.0 for f in group.fields]
    if group.delta is not None:
        values = [a + b for a, b in zip(values, group.delta, strict=True)]
    return tuple(values)


def _encode(message: Any, status: int, content_type: str, outcome: str) -> OtlpReply:
    """A response message in the request's encoding (protobuf when that is unknown)."""
    if content_type == JSON:
        body = json.dumps(json_format.MessageToDict(message), separators=(",", ":")).encode()
        return OtlpReply(status, body, JSON, outcome)
    return OtlpReply(status, message.SerializeToString(), PROTOBUF, outcome)
