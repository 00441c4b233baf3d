"""What a serving source says about its queues, before the exporter maps them to GPUs.

A scrape adapter (Triton, vLLM, TGI, SGLang: one per file in this package) turns one endpoint's
exposition text into :class:`ServingReading` records; the OTLP receiver does the same for
pushed metrics. A reading carries the same measures as the telemetry type
:class:`gpubalance.telemetry.ServingSample` it becomes once the exporter knows its GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from gpubalance.telemetry import ServingMeasures

# Bounds on what one scrape may hold: a server answering with more is broken or hostile.
MAX_EXPOSITION_BYTES = 8 * 1024 * 1024
MAX_FAMILIES = 5000
MAX_SAMPLES = 200_000


class ParseError(ValueError):
    """Exposition text that cannot be used; ``reason`` is a short label for counting."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True, kw_only=True)
class ServingReading(ServingMeasures):
    """One queue of a serving source (a model on a server, an engine, a TP rank, a worker)."""

    key: str  # identifies the queue within its source, e.g. "model=llama,version=1"
    gpu_uuid: str | None = None  # when the source names its GPU (Triton's gpu_uuid)
    rank: int | None = None  # position among the endpoint's GPUs (SGLang tp_rank)
    service_class: str | None = None
    tenant: str | None = None


def parse_exposition(text: str) -> dict[str, Metric]:
    """Families of Prometheus text exposition by name, with a real parser and bounds.

    Raises ParseError (reason ``too_large``, ``too_many_series`` or ``malformed``).
    """
    if len(text) > MAX_EXPOSITION_BYTES:
        raise ParseError("too_large", f"{len(text)} bytes, more than {MAX_EXPOSITION_BYTES}")
    families: dict[str, Metric] = {}
    samples = 0
    try:
        for family in text_string_to_metric_families(text):
            samples += len(family.samples)
            if len(families) >= MAX_FAMILIES or samples > MAX_SAMPLES:
                raise ParseError(
                    "too_many_series", f"more than {MAX_FAMILIES} families or {MAX_SAMPLES} samples"
                )
            families[family.name] = family
    except ParseError:
        raise
    except Exception as exc:  # the parser raises ValueError, IndexError, KeyError, ...
        raise ParseError("malformed", f"{type(exc).__name__}: {exc}") from None
    return families
