"""The snapshot: one JSON document with the latest sample and its window figures.

Served by the exporter at ``/api/v1/snapshot``, written by the lab's fast speed as frames, read
by the analyzer. Its schema is the dataclasses of :mod:`gpubalance.telemetry`; the JSON Schema
in ``docs/snapshot.schema.json`` is generated from them (``gpubalance exporter --print-schema``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter

from gpubalance.telemetry import Sample, Window

SCHEMA = "gpubalance.snapshot/v1"


@dataclass(frozen=True, slots=True)
class Snapshot:
    schema: str
    interval_seconds: float
    window_seconds: float
    trend_window_seconds: float
    sample: Sample
    window: Window
    # Earlier samples, oldest first, when asked for (``?history=N``).
    history: tuple[Sample, ...] = ()


_ADAPTER: TypeAdapter[Snapshot] = TypeAdapter(Snapshot)


def to_json(snapshot: Snapshot) -> bytes:
    return _ADAPTER.dump_json(snapshot)


def to_dict(snapshot: Snapshot) -> dict[str, Any]:
    return _ADAPTER.dump_python(snapshot, mode="json")


def from_json(data: str | bytes) -> Snapshot:
    """Parse and validate a snapshot; raises pydantic.ValidationError naming the bad field."""
    snapshot = _ADAPTER.validate_json(data)
    if snapshot.schema != SCHEMA:
        raise ValueError(f"unsupported snapshot schema {snapshot.schema!r}; expected {SCHEMA!r}")
    return snapshot


def json_schema() -> dict[str, Any]:
    return _ADAPTER.json_schema(mode="serialization")
