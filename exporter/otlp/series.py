"""From decoded OTLP metrics to stored series: one per (worker, class, tenant, GPU).

Eight metrics are known, the rest ignored:

- ``gpubalance.queue.depth``: Gauge or UpDownCounter (non-monotonic Sum) -> queue_depth
- ``gpubalance.batch.assembly_delay``: Histogram in seconds -> batch_assembly_delay_seconds_*
- ``gpubalance.batch.size``: Histogram -> batch_size_sum, batch_size_count
- ``gpubalance.request.duration``: Histogram in seconds -> request_duration_seconds_*
- ``gpubalance.memory.allocation_failures``: Counter (monotonic Sum) -> allocation_failures_total
- ``gpubalance.batch.size.limit``: Gauge -> max_batch_size (the worker's configured batch limit)
- ``gpubalance.prompt.tokens``: Counter -> prompt_tokens_total (prompt tokens prefilled)
- ``gpubalance.generation.tokens``: Counter -> generation_tokens_total (tokens generated)

Attributes come from the data point, else the resource: ``service.instance.id`` (the worker;
"unknown" when missing), ``gpubalance.class``, ``gpubalance.tenant``, ``gpu.uuid`` and
``gpu.index``.

The store keeps cumulative sums: a CUMULATIVE push replaces what is stored, a DELTA push adds
to it. Points of one push that land in the same series (streams that differ only in attributes
we drop) are summed, after keeping the latest point of each stream, so a collector that batches
two exports of one SDK does not double-count.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpubalance.exporter.collectors.serving.base import ServingReading
from gpubalance.exporter.otlp.decode import decode
from gpubalance.exporter.otlp.limits import (
    HISTOGRAMS,
    Attributes,
    Metric,
    OtlpLimits,
    Point,
    Rejected,
    Tally,
    metrics,
    show,
)

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
_GPU_INDEX = re.compile(r"\s*[0-9]{1,4}\s*")


@dataclass(frozen=True, slots=True)
class _Spec:
    kinds: frozenset[str]  # gauge, updown (non-monotonic Sum), counter (monotonic Sum), histogram
    fields: tuple[str, ...]  # ServingReading fields: (value,) or (sum, count)
    seconds: bool = False  # a duration histogram: the unit is converted to seconds


SPECS = {
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
    "gpubalance.batch.size.limit": _Spec(frozenset({"gauge"}), ("max_batch_size",)),
    "gpubalance.prompt.tokens": _Spec(frozenset({"counter"}), ("prompt_tokens_total",)),
    "gpubalance.generation.tokens": _Spec(frozenset({"counter"}), ("generation_tokens_total",)),
}


@dataclass(frozen=True, slots=True)
class Series:
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
        raise Rejected("bad_attribute", f"{key} must be a string, not {show(value)}")
    if len(value) > limits.max_attribute_value_length:
        raise Rejected(
            "attribute_too_long",
            f"{key} is {len(value)} characters, more than {limits.max_attribute_value_length}",
        )
    if not value.isprintable():
        raise Rejected("bad_attribute", f"{key} holds unprintable characters: {show(value)}")
    return value


def _gpu_index(value: object) -> int | None:
    """gpu.index: an int, or digits (OTEL_RESOURCE_ATTRIBUTES makes every value a string)."""
    if value is None or value == "":
        return None
    if isinstance(value, str) and _GPU_INDEX.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_GPU_INDEX:
        raise Rejected("bad_attribute", f"gpu.index must be 0..{MAX_GPU_INDEX}, not {show(value)}")
    return value


def series_of(attributes: Attributes, resource: Attributes, limits: OtlpLimits) -> Series:
    def pick(key: str) -> object:
        return attributes[key] if key in attributes else resource.get(key)

    return Series(
        worker=_label(WORKER, pick(WORKER), limits) or UNKNOWN_WORKER,
        service_class=_label(SERVICE_CLASS, pick(SERVICE_CLASS), limits),
        tenant=_label(TENANT, pick(TENANT), limits),
        gpu_uuid=_label(GPU_UUID, pick(GPU_UUID), limits),
        gpu_index=_gpu_index(pick(GPU_INDEX)),
    )


def _identity(attributes: Attributes) -> tuple[tuple[str, object], ...]:
    return tuple(sorted(attributes.items(), key=lambda kv: kv[0]))


@dataclass(slots=True)
class Group:
    """One metric's points for one series in one request, ready to merge with the store."""

    fields: tuple[str, ...]
    latest: dict[tuple[object, ...], tuple[tuple[int, int], tuple[float, ...]]] = field(
        default_factory=dict
    )  # stream -> ((time, order), values): replacing points (Gauge, CUMULATIVE)
    delta: list[float] | None = None  # the sum of DELTA points
    points: int = 0


@dataclass
class Batch:
    """A decoded request: what to merge into the store, and what was refused or ignored."""

    groups: dict[tuple[Series, str], Group] = field(default_factory=dict)
    rejected: Counter[str] = field(default_factory=Counter)
    ignored: Counter[str] = field(default_factory=Counter)
    details: dict[str, str] = field(default_factory=dict)  # reason -> first detail

    def reject(self, reason: str, detail: str, points: int = 1) -> None:
        if points:
            self.rejected[reason] += points
            self.details.setdefault(reason, detail)


def _instrument(metric: Metric) -> str:
    if metric.kind == "sum":
        return "counter" if metric.monotonic else "updown"
    return "histogram" if metric.kind in HISTOGRAMS else metric.kind


def _point_values(metric: Metric, spec: _Spec, point: Point, delta: bool) -> tuple[float, ...]:
    """The fields a point carries, in base units; raises Rejected for impossible values."""
    where = metric.name
    if len(spec.fields) == 1:
        value = point.value
        if value is None or not math.isfinite(value):
            raise Rejected("invalid_value", f"{where}: value {value} is not a finite number")
        # an UpDownCounter's delta may be negative; the stored depth is checked after the merge
        if value < 0 and not (delta and _instrument(metric) == "updown"):
            raise Rejected("invalid_value", f"{where}: value {value} is negative")
        return (value,)
    total = point.sum
    if total is None:
        if point.count:
            raise Rejected("invalid_value", f"{where}: a histogram point without a sum")
        total = 0.0
    if not math.isfinite(total) or total < 0:
        raise Rejected("invalid_value", f"{where}: histogram sum {total} is not finite and >= 0")
    if spec.seconds:
        total *= SECONDS[metric.unit]
    return (total, float(point.count))


def _metric_refusal(metric: Metric, spec: _Spec) -> Rejected | None:
    """Why none of a metric's points can be used, if so."""
    instrument = _instrument(metric)
    if instrument not in spec.kinds:
        kinds = "/".join(sorted(spec.kinds))
        return Rejected("wrong_type", f"{metric.name} must be {kinds}, not {instrument or 'empty'}")
    if metric.kind != "gauge" and metric.temporality not in (DELTA, CUMULATIVE):
        return Rejected(
            "bad_temporality", f"{metric.name}: temporality {metric.temporality} is not 1 or 2"
        )
    if spec.seconds and metric.unit not in SECONDS:
        return Rejected("wrong_unit", f"{metric.name} must be in s, not {show(metric.unit)}")
    if isinstance(metric.resource, Rejected):
        return Rejected(metric.resource.reason, f"resource: {metric.resource.detail}")
    return None


def _add_metric(batch: Batch, metric: Metric, limits: OtlpLimits, order: Iterator[int]) -> None:
    spec = SPECS[metric.name]
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
            if isinstance(point.attributes, Rejected):
                raise point.attributes
            series = series_of(point.attributes, metric.resource, limits)
            values = _point_values(metric, spec, point, delta)
        except Rejected as rejected:
            batch.reject(rejected.reason, rejected.detail)
            continue
        group = batch.groups.setdefault((series, metric.name), Group(spec.fields))
        group.points += 1
        if delta:
            previous = group.delta or [0.0] * len(values)
            group.delta = [a + b for a, b in zip(previous, values, strict=True)]
        else:
            stream = (resource_id, metric.scope, _identity(point.attributes))
            stamp = (point.time_unix_nano, next(order))
            if stream not in group.latest or group.latest[stream][0] < stamp:
                group.latest[stream] = (stamp, values)


def changes_of(
    batch: Batch, groups: list[tuple[str, Group]], reading: ServingReading
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


def _merge(group: Group, reading: ServingReading) -> tuple[float, ...]:
    """The group's fields after this push: replaced by the latest of each stream (summed over
    streams), else the stored totals; plus the DELTA points."""
    if group.latest:
        values = [sum(v[i] for _, v in group.latest.values()) for i in range(len(group.fields))]
    else:
        values = [getattr(reading, f) or 0.0 for f in group.fields]
    if group.delta is not None:
        values = [a + b for a, b in zip(values, group.delta, strict=True)]
    return tuple(values)


def read_batch(body: bytes, content_type: str, content_encoding: str, limits: OtlpLimits) -> Batch:
    """Turn one request body into what to store; pure, so it can run in a worker thread.

    ``content_encoding`` is "gzip" when the body is still compressed. Raises Refused.
    """
    skipped = Tally.of(limits)  # what JSON decoding dropped before parsing
    request = decode(body, content_type, content_encoding, limits, skipped, SPECS)
    tally = Tally.of(limits)
    batch = Batch()
    order = itertools.count()
    for metric in metrics(request, limits, tally, SPECS):
        _add_metric(batch, metric, limits, order)
    batch.reject(
        "too_many_points",
        f"more than {limits.max_points_per_request} in one request",
        skipped.over_budget + tally.over_budget,
    )
    batch.ignored.update(skipped.ignored)
    batch.ignored.update(tally.ignored)
    return batch
