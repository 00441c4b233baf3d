"""What one OTLP request may carry, applied once, on the decoded messages.

:func:`metrics` walks an ``ExportMetricsServiceRequest`` (from protobuf or JSON alike) and
yields the metrics of known names as plain values, with at most ``max_points_per_request``
points; an attribute list too wide or too deep rejects its point (or every point under its
resource), a request with too many resources, scopes and metrics is refused.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

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
    # JSON values (objects, arrays, scalars) handed to json_format, which takes 2-7 µs each;
    # a 10,000-point request of gauges with three attributes holds about 160,000
    max_json_values: int = 250_000
    # bodies decoded at once; a hostile 4 MiB body holds up to ~170 MB while it decodes
    max_concurrent_decodes: int = 2


DEFAULT_LIMITS = OtlpLimits()


class Refused(Exception):
    """The whole request is refused: HTTP ``status`` with a counted ``reason``."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


class Rejected(Exception):
    """One point (or every point under one resource) is refused for ``reason``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def malformed(detail: str) -> Refused:
    return Refused(400, "malformed", detail)


def show(value: object) -> str:
    """A sender's value for a message: short, and repr() escapes what UTF-8 cannot carry."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class Tally:
    """Budgets and counts of one walk through a request."""

    points: int  # points still to take
    entries: int  # resource, scope and metric entries still to visit
    over_budget: int = 0  # points past max_points_per_request, left undecoded
    ignored: Counter[str] = field(default_factory=Counter)  # reason -> points not for us

    @classmethod
    def of(cls, limits: OtlpLimits) -> Tally:
        return cls(points=limits.max_points_per_request, entries=limits.max_points_per_request)

    def visit(self, n: int) -> None:
        """Account for ``n`` entries before iterating them: ~1M empty ones cost seconds."""
        self.entries -= n
        if self.entries < 0:
            raise Refused(
                413,
                "too_many_metrics",
                "more resources, scopes and metrics in one request than max_points_per_request;"
                " send smaller batches",
            )

    def take(self, n: int) -> int:
        """How many of ``n`` points fit in the budget; the rest count as over it."""
        taken = min(n, self.points)
        self.points -= taken
        self.over_budget += n - taken
        return taken


# -- plain values of what a request says ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class KvList:
    """A kvlist AnyValue as a hashable value (an array becomes a tuple)."""

    items: tuple[tuple[str, object], ...]


Attributes = dict[str, object]


@dataclass(slots=True)
class Point:
    attributes: Attributes | Rejected
    time_unix_nano: int
    flags: int
    value: float | None = None  # Gauge and Sum
    sum: float | None = None  # histograms
    count: int = 0


@dataclass(slots=True)
class Metric:
    """One metric of a known name, with the points the request's budget takes."""

    name: str
    kind: str  # gauge, sum, histogram, exponential_histogram, summary or "" (no data)
    monotonic: bool
    temporality: int
    unit: str
    resource: Attributes | Rejected
    scope: str
    points: list[Point]


def _check_width(n: int, limits: OtlpLimits) -> None:
    if n > limits.max_attributes:
        raise Rejected("too_many_attributes", f"{n} attributes, more than {limits.max_attributes}")


def _value(value: Any, depth: int, limits: OtlpLimits) -> object:
    if depth > limits.max_any_value_depth:
        raise Rejected(
            "attribute_too_deep", f"an attribute nests deeper than {limits.max_any_value_depth}"
        )
    kind = value.WhichOneof("value")
    if kind == "array_value":
        items = value.array_value.values
        _check_width(len(items), limits)
        return tuple(_value(v, depth + 1, limits) for v in items)
    if kind == "kvlist_value":
        pairs = value.kvlist_value.values
        _check_width(len(pairs), limits)
        return KvList(tuple((kv.key, _value(kv.value, depth + 1, limits)) for kv in pairs))
    return None if kind is None else getattr(value, kind)


def _attributes(kvs: Sequence[Any], limits: OtlpLimits) -> Attributes | Rejected:
    try:
        _check_width(len(kvs), limits)
        return {kv.key: _value(kv.value, 1, limits) for kv in kvs}
    except Rejected as rejected:
        return rejected


def _point(kind: str, p: Any, limits: OtlpLimits) -> Point:
    point = Point(_attributes(p.attributes, limits), p.time_unix_nano, p.flags)
    if kind in ("gauge", "sum"):
        which = p.WhichOneof("value")
        point.value = None if which is None else float(getattr(p, which))
    elif kind in HISTOGRAMS:
        point.count = p.count
        point.sum = p.sum if p.HasField("sum") else None
    return point


def metrics(
    request: ExportMetricsServiceRequest, limits: OtlpLimits, tally: Tally, known: Container[str]
) -> Iterator[Metric]:
    """The request's metrics named in ``known``; other metrics' points are counted as ignored."""
    tally.visit(len(request.resource_metrics))
    for rm in request.resource_metrics:
        resource: Attributes | Rejected | None = None  # decoded when a known metric needs it
        tally.visit(len(rm.scope_metrics))
        for sm in rm.scope_metrics:
            tally.visit(len(sm.metrics))
            for m in sm.metrics:
                kind = m.WhichOneof("data") or ""
                data = getattr(m, kind) if kind else None
                points = data.data_points if data is not None else ()
                if m.name not in known:
                    tally.ignored["unknown_metric"] += len(points)
                    continue
                if resource is None:
                    resource = _attributes(rm.resource.attributes, limits)
                take = tally.take(len(points))
                yield Metric(
                    name=m.name,
                    kind=kind,
                    monotonic=kind == "sum" and m.sum.is_monotonic,
                    temporality=getattr(data, "aggregation_temporality", 0),
                    unit=m.unit,
                    resource=resource,
                    scope=sm.scope.name,
                    points=[_point(kind, p, limits) for p in points[:take]],
                )
