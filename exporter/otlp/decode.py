"""From a request body to an ``ExportMetricsServiceRequest``: gzip, protobuf or OTLP/JSON.

OTLP/JSON is proto3's JSON mapping, which protobuf's ``json_format`` parses into the same
messages as the binary encoding, but for the OTLP specification's deviations ("JSON Protobuf
Encoding"): ``traceId`` and ``spanId`` are hex, not base64 (converted here); enums are integers,
never names (checked here: ``json_format`` takes names, and fails on Infinity); keys are
lowerCamelCase (``json_format`` also takes the proto names, as the OpenTelemetry Collector
does); 64-bit integers come as strings or numbers; unknown fields are ignored.

``json_format`` builds a message in about 7 µs, so a hostile 4 MiB body of a million empty
points would take seconds. Before it runs, the JSON tree loses what the limits would skip on
the messages (metrics of unknown names, points past ``max_points_per_request``; both counted
in the caller's Tally), and a tree still holding more than ``max_json_values`` values is
refused.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import zlib
from collections.abc import Container
from functools import cache
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from gpubalance.exporter.otlp.limits import OtlpLimits, Refused, Tally, malformed, show

PROTOBUF = "application/x-protobuf"
JSON = "application/json"

# JSON names of Metric's data oneof; those with an aggregationTemporality
_KINDS = ("gauge", "sum", "histogram", "exponentialHistogram", "summary")
_TEMPORAL = frozenset({"sum", "histogram", "exponentialHistogram"})
_IDS = ("traceId", "spanId")
_REASON_LENGTH = 300  # of json_format's messages, which quote the offending value
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # the \u escape of a UTF-16 surrogate


def decode(
    body: bytes,
    content_type: str,
    content_encoding: str,
    limits: OtlpLimits,
    tally: Tally,
    known: Container[str],
) -> ExportMetricsServiceRequest:
    """The request in ``body``; ``content_encoding`` is "gzip" when it is still compressed.

    For JSON, ``tally`` is charged with what is dropped before parsing (metrics not in
    ``known``, points past the budget). Raises Refused.
    """
    if content_encoding == "gzip":
        body = gunzip(body, limits.max_body_bytes)
    if content_type == JSON:
        return _from_json(body, limits, tally, known)
    try:
        return ExportMetricsServiceRequest.FromString(body)
    except DecodeError as exc:
        raise malformed(f"not an ExportMetricsServiceRequest: {exc}") from None


def gunzip(data: bytes, limit: int) -> bytes:
    """Decompress gzip member by member, stopping one byte past ``limit`` (a gzip bomb)."""
    out = bytearray()
    try:
        while data:
            member = zlib.decompressobj(wbits=zlib.MAX_WBITS | 16)
            out += member.decompress(data, limit + 1 - len(out))
            if len(out) > limit:
                raise Refused(
                    413, "decompressed_too_large", f"the body inflates past {limit} bytes"
                )
            if not member.eof:
                raise Refused(400, "bad_compression", "the gzip body is truncated")
            data = member.unused_data
    except zlib.error as exc:
        raise Refused(400, "bad_compression", f"the body is not gzip: {exc}") from None
    return bytes(out)


def _from_json(
    body: bytes, limits: OtlpLimits, tally: Tally, known: Container[str]
) -> ExportMetricsServiceRequest:
    try:
        root = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise malformed(f"not JSON: {exc}") from None
    if not isinstance(root, dict):
        raise malformed("the body must be a JSON object (an ExportMetricsServiceRequest)")
    points = _clip(root, tally, known)
    _check_values(body, root, limits.max_json_values)
    for point in points:
        _ids_to_base64(point)
    try:
        return json_format.ParseDict(
            root, ExportMetricsServiceRequest(), ignore_unknown_fields=True
        )
    except (json_format.ParseError, RecursionError) as exc:
        # the message quotes the sender's value, which may hold what UTF-8 cannot carry
        reason = str(exc).encode("utf-8", "backslashreplace").decode()
        if len(reason) > _REASON_LENGTH:
            reason = reason[: _REASON_LENGTH - 3] + "..."
        raise malformed(f"not an OTLP/JSON ExportMetricsServiceRequest: {reason}") from None


@cache
def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name)


def _field(obj: dict[str, Any], name: str) -> Any:
    """A field by its JSON name or its proto name; both at once is malformed, as json_format
    would find, but only after parsing the first of them."""
    snake = _snake(name)
    if name in obj and snake != name and snake in obj:
        raise malformed(f"both {name} and {snake} are given")
    return obj[name] if name in obj else obj.get(snake)


def _list(obj: Any, name: str) -> list[Any]:
    """A repeated field of an object; [] where either is of the wrong type, which json_format
    refuses when it meets it."""
    value = _field(obj, name) if isinstance(obj, dict) else None
    return value if isinstance(value, list) else []


def _clip(root: dict[str, Any], tally: Tally, known: Container[str]) -> list[Any]:
    """Drop, in place, the metrics not in ``known`` and the points past the budget, as the
    walk over the messages would skip them; returns the points kept."""
    kept_points: list[Any] = []
    resource_metrics = _list(root, "resourceMetrics")
    tally.visit(len(resource_metrics))
    for rm in resource_metrics:
        scope_metrics = _list(rm, "scopeMetrics")
        tally.visit(len(scope_metrics))
        for sm in scope_metrics:
            metrics = _list(sm, "metrics")
            tally.visit(len(metrics))
            kept = []
            for m in metrics:
                kind, data = _data(m)
                points = _list(data, "dataPoints")
                name = m.get("name", "") if isinstance(m, dict) else None
                if isinstance(name, str) and name not in known:
                    tally.ignored["unknown_metric"] += len(points)
                    continue
                if kind in _TEMPORAL:
                    _check_enum(data, "aggregationTemporality")
                del points[tally.take(len(points)) :]
                kept_points.extend(points)
                kept.append(m)
            metrics[:] = kept
    return kept_points


def _data(metric: Any) -> tuple[str, Any]:
    """The kind and the object of a metric's data, ("", None) when it has none."""
    if isinstance(metric, dict):
        for kind in _KINDS:
            if isinstance(data := _field(metric, kind), dict):
                return kind, data
    return "", None


def _check_enum(obj: dict[str, Any], name: str) -> None:
    """OTLP/JSON encodes an enum as an integer, never its name; json_format would take a name,
    fail with OverflowError on Infinity and take 1.5 for 1."""
    value = _field(obj, name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise malformed(f"{name} must be an integer (OTLP/JSON enums are), not {show(value)}")


def _check_values(body: bytes, root: Any, limit: int) -> None:
    """Refuse a tree of more than ``limit`` values (objects, arrays, scalars), or with a string
    UTF-8 cannot carry (a lone surrogate from a \\u escape), on which upb fails oddly."""
    # Most bodies need no walk: every value but the root follows a ":", "," or "[" (or more
    # of them, in strings), and a surrogate comes from a \u escape.
    bound = body.count(b":") + body.count(b",") + body.count(b"[")
    if bound < limit and _SURROGATE.search(body) is None:
        return
    stack = [root]
    seen = 0
    while stack:
        value = stack.pop()
        seen += 1
        if isinstance(value, dict):
            for key in value:
                if not _utf8(key):
                    raise _surrogate(key)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str) and not _utf8(value):
            raise _surrogate(value)
        if seen + len(stack) > limit:
            raise Refused(
                413,
                "too_many_values",
                f"the JSON body holds more than {limit} values (max_json_values);"
                " send smaller batches, or protobuf",
            )


def _utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _surrogate(text: str) -> Refused:
    return malformed(f"a string holds a lone surrogate, which UTF-8 cannot carry: {show(text)}")


def _ids_to_base64(point: Any) -> None:
    """An exemplar's hex traceId and spanId, as the base64 json_format expects of bytes."""
    for exemplar in _list(point, "exemplars"):
        if not isinstance(exemplar, dict):
            continue
        for name in _IDS:
            for key in (name, _snake(name)):
                value = exemplar.get(key)
                if isinstance(value, str):
                    try:
                        exemplar[key] = base64.b64encode(binascii.unhexlify(value)).decode()
                    except (binascii.Error, ValueError):
                        raise malformed(f"exemplar {name} must be hex, not {show(value)}") from None
