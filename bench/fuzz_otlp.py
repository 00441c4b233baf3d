"""Fuzz the OTLP receiver: mutated requests must end in 200 (maybe a partial success) or a 4xx,
never in an exception, and in bounded memory.

OTLP half of bench/fuzz.py (same result shape, so its report() takes it): valid requests of
the five gpubalance metrics (with exemplars, nested attributes and unknown metrics beside them)
are encoded as protobuf and as OTLP JSON, then mutated: messages that still parse but carry
hostile values, attributes, temporalities, units and instrument kinds; protobuf bytes (bit
flips, deletions, duplications, random bytes, extreme varints, splices, truncation); JSON trees
(nodes replaced by hostile values, keys renamed or dropped, lists multiplied) and JSON text; or
built from scratch as random JSON. Some go gzip-compressed, some with a wrong Content-Type or
Content-Encoding, and one in 250 (more in a short run) is one of the classic attacks (gzip bomb,
oversized body, deep nesting, attribute flood, point flood). All go through
``OtlpReceiver.process`` into one store, as into a long-lived exporter. Deterministic for a
given seed, apart from time and memory figures.

    python bench/fuzz_otlp.py [--otlp 100000] [--seed 0]
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import random
import resource
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from gpubalance.exporter.collectors.serving.store import ServingStore
from gpubalance.exporter.otlp import JSON, PROTOBUF, OtlpLimits, OtlpReceiver

MIB = 1024 * 1024
Input = tuple[bytes, str, str]  # body, Content-Type, Content-Encoding

# Values a JSON mutation puts in place of a node: every JSON type, OTLP's special strings, and
# what breaks naive code (huge numbers, surrogates, control characters, deep or wide nests).
HOSTILE: tuple[Any, ...] = (
    None,
    True,
    0,
    -1,
    2**63,
    -(2**64),
    10**400,
    1.5,
    -0.0,
    1e308,
    float("nan"),
    float("inf"),
    "",
    "NaN",
    "-Infinity",
    "18446744073709551616",
    "0x10",
    "\ud800",
    "\x00\n",
    "é" * 300,
    "A" * 10_000,
    "AGGREGATION_TEMPORALITY_DELTA",
    "zz==",
    [],
    [None, 1, "a"],
    {},
    {"stringValue": "x"},
    {"intValue": "12"},
    {"kvlistValue": {"values": [{"key": "k", "value": {"boolValue": "no"}}]}},
    {"arrayValue": {"values": [{"doubleValue": "Infinity"}] * 50}},
)
HOSTILE_JSON = tuple(json.dumps(value) for value in HOSTILE)  # loads() copies fast
KEYS = (
    "resourceMetrics",
    "scopeMetrics",
    "metrics",
    "name",
    "unit",
    "gauge",
    "sum",
    "histogram",
    "exponentialHistogram",
    "summary",
    "dataPoints",
    "asInt",
    "asDouble",
    "count",
    "sum",
    "flags",
    "timeUnixNano",
    "aggregationTemporality",
    "isMonotonic",
    "attributes",
    "key",
    "value",
    "resource",
    "stringValue",
    "intValue",
    "kvlistValue",
    "arrayValue",
    "values",
    "exemplars",
    "traceId",
)
NAMES = (
    "gpubalance.queue.depth",
    "gpubalance.batch.assembly_delay",
    "gpubalance.batch.size",
    "gpubalance.request.duration",
    "gpubalance.memory.allocation_failures",
    "http.server.duration",
)
NUMBERS = (float("nan"), float("inf"), float("-inf"), -1.0, -0.0, 0.0, 5e-324, 1e308, 7.0)
INTEGERS = (-(2**63), -1, 0, 1, 2**63 - 1)
ATTRIBUTE_KEYS = (
    "service.instance.id",
    "gpu.uuid",
    "gpu.index",
    "gpubalance.class",
    "gpubalance.tenant",
    "other",
)
VARINTS = (b"\xff" * 10 + b"\x01", b"\x80" * 9 + b"\x7f", b"\x00", b"\xff\xff\xff\xff\x0f")


# -- valid requests ------------------------------------------------------------------------------


def _kv(key: str, value: object) -> KeyValue:
    kv = KeyValue(key=key)
    if isinstance(value, str):
        kv.value.string_value = value
    elif isinstance(value, int):
        kv.value.int_value = value
    else:
        kv.value.kvlist_value.values.append(_kv("inner", "x"))
    return kv


def valid_request(rng: random.Random, temporality: int = 2) -> ExportMetricsServiceRequest:
    """A request with all five metrics for a few tenants, plus noise the receiver must skip."""
    request = ExportMetricsServiceRequest()
    for worker in range(rng.randint(1, 3)):
        rm = request.resource_metrics.add()
        rm.resource.attributes.extend(
            [
                _kv("service.name", "fuzz"),
                _kv("service.instance.id", f"w{worker}"),
                _kv("gpu.uuid", f"GPU-{worker:08x}"),
                _kv("gpu.index", worker),
                _kv("gpubalance.class", rng.choice(("chat", "batch"))),
                _kv("nested", {}),
            ]
        )
        sm = rm.scope_metrics.add()
        sm.scope.name = "gpubalance"
        depth = sm.metrics.add(name="gpubalance.queue.depth")
        depth.gauge.data_points.add(as_int=rng.randint(0, 50), time_unix_nano=1)
        for name, unit in (
            ("gpubalance.batch.assembly_delay", "s"),
            ("gpubalance.batch.size", "{request}"),
            ("gpubalance.request.duration", "ms"),
        ):
            metric = sm.metrics.add(name=name, unit=unit)
            metric.histogram.aggregation_temporality = temporality
            for tenant in ("a", "b"):
                point = metric.histogram.data_points.add(
                    count=rng.randint(0, 9), sum=rng.random() * 9, time_unix_nano=2
                )
                point.attributes.append(_kv("gpubalance.tenant", tenant))
                point.bucket_counts.extend([1, 2])
                point.explicit_bounds.append(0.5)
                point.exemplars.add(
                    as_double=0.1, trace_id=bytes(range(16)), span_id=bytes(range(8))
                )
        failures = sm.metrics.add(name="gpubalance.memory.allocation_failures")
        failures.sum.aggregation_temporality = temporality
        failures.sum.is_monotonic = True
        failures.sum.data_points.add(as_int=rng.randint(0, 3))
        sm.metrics.add(name="http.server.duration").gauge.data_points.add(as_double=1.0)
    return request


def otlp_json(request: ExportMetricsServiceRequest) -> dict[str, Any]:
    """The OTLP JSON form: enums as integers, trace and span ids in hex (not base64)."""
    tree = json_format.MessageToDict(request, use_integers_for_enums=True)
    for rm in tree.get("resourceMetrics", ()):
        for sm in rm.get("scopeMetrics", ()):
            for metric in sm.get("metrics", ()):
                for data in metric.values():
                    for point in data.get("dataPoints", ()) if isinstance(data, dict) else ():
                        for exemplar in point.get("exemplars", ()):
                            for key in ("traceId", "spanId"):
                                exemplar[key] = base64.b64decode(exemplar[key]).hex()
    return tree


# -- mutations -------------------------------------------------------------------------------


def _span(data: bytes, rng: random.Random, longest: int = 64) -> tuple[int, int]:
    start = rng.randrange(len(data) + 1)
    return start, min(len(data), start + rng.randint(1, longest))


def _flip(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if out:
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def _delete(data: bytes, rng: random.Random) -> bytes:
    start, end = _span(data, rng)
    return data[:start] + data[end:]


def _duplicate(data: bytes, rng: random.Random) -> bytes:
    start, end = _span(data, rng, 400)
    return data[:end] + data[start:end] * rng.randint(1, 20) + data[end:]


def _random_bytes(data: bytes, rng: random.Random) -> bytes:
    at = rng.randrange(len(data) + 1)
    junk = rng.choice(VARINTS) if rng.random() < 0.3 else rng.randbytes(rng.randint(1, 8))
    return data[:at] + junk + data[at:]


def _truncate(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data) + 1)]


BYTE_MUTATIONS: tuple[Callable[[bytes, random.Random], bytes], ...] = (
    _flip,
    _delete,
    _duplicate,
    _random_bytes,
    _truncate,
)


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    for _ in range(rng.randint(1, 3)):
        data = rng.choice(BYTE_MUTATIONS)(data, rng)
    return data


def _random_path(tree: Any, rng: random.Random) -> list[Any]:
    """The path to a node of a JSON tree, found by a random descent (deep ones are rarer)."""
    path: list[Any] = []
    while isinstance(tree, dict | list) and tree and rng.random() < 0.9:
        step = rng.choice(list(tree)) if isinstance(tree, dict) else rng.randrange(len(tree))
        path.append(step)
        tree = tree[step]
    return path


def random_json(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value, its objects keyed mostly by OTLP field names."""
    roll = rng.random()
    if depth > 6 or roll < 0.4:
        return json.loads(rng.choice(HOSTILE_JSON))
    if roll < 0.7:
        return {rng.choice(KEYS): random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]


def mutate_json(text: str, rng: random.Random) -> Any:
    """The JSON ``text`` as a tree, with one to four nodes replaced, dropped, renamed or
    multiplied."""
    tree = json.loads(text)
    for _ in range(rng.randint(1, 4)):
        path = _random_path(tree, rng)
        if not path:
            return random_json(rng)
        parent = tree
        for step in path[:-1]:
            parent = parent[step]
        last = path[-1]
        roll = rng.random()
        if roll < 0.5:
            parent[last] = random_json(rng)
        elif roll < 0.65 and isinstance(parent, dict):
            del parent[last]
        elif roll < 0.8 and isinstance(parent, dict):
            snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in str(last))
            parent[snake] = parent.pop(last)
        elif isinstance(parent[last], list):
            parent[last] = parent[last] * rng.randint(2, 8)
        else:
            parent[last] = [parent[last]]
    return tree


def _hostile_value(rng: random.Random, depth: int = 0) -> AnyValue:
    """An attribute value of any type, some unprintable, long, negative or deeply nested."""
    value = AnyValue()
    roll = rng.random()
    if roll < 0.3:
        value.string_value = rng.choice(
            ("", "gpu0", "a,b=c%", "\n", "\x7f", "é" * 300, "7", " 7 ", "9" * 5000)
        )
    elif roll < 0.5:
        value.int_value = rng.choice(INTEGERS)
    elif roll < 0.6:
        value.double_value = rng.choice(NUMBERS)
    elif roll < 0.7:
        value.bool_value = rng.random() < 0.5
    elif roll < 0.75:
        value.bytes_value = rng.randbytes(rng.randint(0, 8))
    elif roll < 0.9 and depth < 12:
        value.array_value.values.extend(_hostile_value(rng, depth + 1) for _ in range(3))
    elif depth < 12:
        value.kvlist_value.values.append(KeyValue(key="k", value=_hostile_value(rng, depth + 1)))
    return value


def mutate_message(
    message: ExportMetricsServiceRequest, rng: random.Random
) -> ExportMetricsServiceRequest:
    """A copy of a valid request that still parses, with hostile values, types and attributes:
    what reaches the receiver's validation rather than its parser."""
    message = ExportMetricsServiceRequest.FromString(message.SerializeToString())
    for _ in range(rng.randint(1, 4)):
        rm = rng.choice(message.resource_metrics)
        metric = rng.choice(rm.scope_metrics[0].metrics)
        kind = metric.WhichOneof("data")
        data = getattr(metric, kind)
        point = rng.choice(data.data_points) if data.data_points else None
        roll = rng.random()
        if roll < 0.25 and point is not None:
            if kind in ("gauge", "sum"):
                if rng.random() < 0.5:
                    point.as_double = rng.choice(NUMBERS)
                else:
                    point.as_int = rng.choice(INTEGERS)
            else:
                point.sum = rng.choice(NUMBERS)
                point.count = rng.choice((0, 1, 2**64 - 1))
            point.flags = rng.randrange(4)
        elif roll < 0.5:
            holder = point if point is not None and rng.random() < 0.5 else rm.resource
            holder.attributes.add(key=rng.choice(ATTRIBUTE_KEYS)).value.CopyFrom(
                _hostile_value(rng)
            )
        elif roll < 0.6 and kind not in ("gauge", "summary"):
            data.aggregation_temporality = rng.choice((0, 1, 2, 7))
        elif roll < 0.7:
            metric.name = rng.choice(NAMES)
        elif roll < 0.8:
            metric.unit = rng.choice(("", "s", "ms", "us", "min", "\x00"))
        elif roll < 0.9:  # the same points under another instrument kind
            other = rng.choice(("gauge", "sum", "histogram", "exponential_histogram", "summary"))
            getattr(metric, other).SetInParent()
            if other not in ("gauge", "summary"):
                getattr(metric, other).aggregation_temporality = rng.choice((1, 2))
            getattr(metric, other).data_points.add()
        elif point is not None:  # the same stream again and again, as a batching collector
            data.data_points.extend([point] * rng.randint(1, 50))
    return message


# -- the classic attacks, built once --------------------------------------------------------


def attacks(limits: OtlpLimits) -> list[Input]:
    """One input per attack the receiver must refuse or bound."""
    limit = limits.max_body_bytes
    flood = ExportMetricsServiceRequest()
    points = flood.resource_metrics.add().scope_metrics.add().metrics.add()
    points.name = "gpubalance.queue.depth"
    for i in range(limits.max_points_per_request * 3):
        points.gauge.data_points.add(as_int=i % 7)
    nested = AnyValue(string_value="x")
    for _ in range(40):
        outer = AnyValue()
        outer.array_value.values.append(nested)
        nested = outer
    deep = ExportMetricsServiceRequest()
    deep_rm = deep.resource_metrics.add()
    deep_rm.resource.attributes.add(key="deep").value.CopyFrom(nested)
    deep_rm.scope_metrics.add().metrics.add(name="gpubalance.queue.depth").gauge.data_points.add()
    wide = ExportMetricsServiceRequest()
    wide_rm = wide.resource_metrics.add()
    wide_rm.resource.attributes.extend(_kv(f"k{i}", "v") for i in range(5000))
    wide_rm.scope_metrics.add().metrics.add(name="gpubalance.queue.depth").gauge.data_points.add()
    empty_points = ",".join(["{}"] * (limit // 3 - 40))
    point_flood = (
        '{"resourceMetrics":[{"scopeMetrics":[{"metrics":[{"name":"gpubalance.queue.depth",'
        f'"gauge":{{"dataPoints":[{empty_points}]}}}}]}}]}}]}}'
    )
    return [
        (gzip.compress(b"\0" * (limit * 50)), PROTOBUF, "gzip"),  # a gzip bomb
        (gzip.compress(b"{" * (limit * 2)), JSON, "gzip"),
        (b"\0" * (limit + 1), PROTOBUF, ""),  # just past the limit
        (b"[" * (limit // 2), JSON, ""),  # nesting the JSON parser must refuse
        (flood.SerializeToString(), PROTOBUF, ""),  # past max_points_per_request
        (deep.SerializeToString(), PROTOBUF, ""),
        (wide.SerializeToString(), PROTOBUF, ""),
        (b"\x0a\x02\x12\x00" * (limit // 4 - 1), PROTOBUF, ""),  # ~1M empty scopes
        (point_flood.encode(), JSON, ""),  # ~1M empty points: JSON's costliest body
    ]


# -- the run -------------------------------------------------------------------------------


def make_input(
    rng: random.Random,
    requests: list[ExportMetricsServiceRequest],
    seeds: list[bytes],
    texts: list[str],
) -> Input:
    """One fuzzed request: a body, its Content-Type and Content-Encoding."""
    roll = rng.random()
    if roll < 0.3:
        message = mutate_message(rng.choice(requests), rng)
        if rng.random() < 0.7:
            body, content_type = message.SerializeToString(), PROTOBUF
        else:
            body, content_type = json.dumps(otlp_json(message)).encode(), JSON
    elif roll < 0.5:
        body, content_type = mutate_bytes(rng.choice(seeds), rng), PROTOBUF
        if rng.random() < 0.1:  # a splice of two requests
            body += rng.choice(seeds)[rng.randrange(50) :]
    elif roll < 0.75:
        tree = mutate_json(rng.choice(texts), rng)
        body, content_type = json.dumps(tree).encode("utf-8", "surrogatepass"), JSON
    elif roll < 0.85:
        body, content_type = mutate_bytes(rng.choice(texts).encode(), rng), JSON
    elif roll < 0.95:
        body, content_type = json.dumps(random_json(rng)).encode("utf-8", "surrogatepass"), JSON
    else:  # a valid request, to keep the store busy
        body, content_type = rng.choice(seeds), PROTOBUF
    encoding = ""
    if rng.random() < 0.15:
        body, encoding = gzip.compress(body, compresslevel=1), "gzip"
        if rng.random() < 0.3:
            body = mutate_bytes(body, rng)
    if rng.random() < 0.02:
        content_type = rng.choice(("text/plain", "application/protobuf", "", JSON, PROTOBUF))
        encoding = rng.choice(("deflate", "br", "GZIP", " identity", encoding))
    return body, content_type, encoding


def fuzz_otlp(n: int = 100_000, seed: int = 0, limits: OtlpLimits | None = None) -> dict[str, Any]:
    """Send ``n`` fuzzed requests through the receiver; counts, memory and speed.

    The result has fuzz_exposition's shape: ``inputs``, ``clean`` (answered 200),
    ``parse_errors`` (refusal "status reason" -> count), ``crashes`` (an exception out of the
    receiver) with the first few in ``crash_examples``, ``tracemalloc_peak_bytes``,
    ``max_rss_bytes`` (of the whole process so far), ``seconds``; and OTLP's own: ``outcomes``
    ("status reason" -> count, 200s as accepted or partial), ``rejected_points`` (reason ->
    points) and ``stored_series`` (the store after the run).
    """
    rng = random.Random(seed)
    limits = limits or OtlpLimits()
    requests = [valid_request(rng, temporality) for temporality in (1, 2, 2, 0)]
    seeds = [request.SerializeToString() for request in requests]
    texts = [json.dumps(otlp_json(request)) for request in requests]
    special = attacks(limits)
    every = max(1, min(250, n // len(special)))  # a short run still meets every attack
    store = ServingStore()
    receiver = OtlpReceiver(store, limits)
    outcomes: Counter[str] = Counter()
    crashes = 0
    examples: list[str] = []
    tracemalloc.start()
    started = time.perf_counter()
    for i in range(n):
        if i % every == every - 1:
            body, content_type, encoding = special[(i // every) % len(special)]
        else:
            body, content_type, encoding = make_input(rng, requests, seeds, texts)
        try:
            reply = receiver.process(body, content_type, encoding)
        except Exception as exc:  # the finding: anything escaped the receiver
            crashes += 1
            if len(examples) < 5:
                examples.append(f"{exc!r} on {content_type} {encoding} {body[:300]!r}")
            continue
        outcomes[f"{reply.status} {reply.outcome}"] += 1
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    stats = receiver.stats()
    return {
        "inputs": n,
        "clean": outcomes["200 accepted"] + outcomes["200 partial"],
        "parse_errors": {k: v for k, v in sorted(outcomes.items()) if not k.startswith("200")},
        "crashes": crashes,
        "crash_examples": examples,
        "tracemalloc_peak_bytes": peak,
        "traced": n,  # every input runs under tracemalloc
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "seconds": seconds,
        "outcomes": dict(sorted(outcomes.items())),
        "rejected_points": dict(sorted(stats.rejected_points.items())),
        "stored_series": len(store),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--otlp", type=int, default=100_000, help="fuzzed requests to send")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = fuzz_otlp(args.otlp, args.seed)
    print(json.dumps(result, indent=2))
    return 1 if result["crashes"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
