"""The collector contract: one collector per file, each switchable and timed on its own.

A collector fills its part of a :class:`SampleParts`; the sampler times it and records a
:class:`~gpubalance.telemetry.CollectorResult`, so one broken collector costs its own series,
not the sample (node_exporter's ``scrape_collector_success`` pattern).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from gpubalance.telemetry import (
    GpuSample,
    HostSample,
    NvmlStatus,
    ProcessHostStats,
    ServingSample,
    ServingSourceStatus,
)

if TYPE_CHECKING:
    from gpubalance.exporter.config import ExporterConfig


class NoDataError(Exception):
    """The source has nothing to give on this machine; the message names the fix."""


@dataclass
class SampleParts:
    """What the collectors of one sample have gathered so far, in registry order."""

    timestamp_seconds: float
    nvml: NvmlStatus | None = None
    gpus: tuple[GpuSample, ...] = ()
    host: HostSample | None = None
    processes: dict[int, ProcessHostStats] = field(default_factory=dict)
    serving: tuple[ServingSample, ...] = ()
    serving_sources: tuple[ServingSourceStatus, ...] = ()


class Collector(Protocol):
    name: str

    def update(self, parts: SampleParts) -> None:
        """Fill this collector's part of the sample; raise on failure."""

    def close(self) -> None:
        """Release what the collector holds (NVML, files)."""


@dataclass(frozen=True)
class CollectorSpec:
    name: str
    factory: Callable[[ExporterConfig], Collector]
    default_enabled: bool
    order: int  # collectors run in this order: later ones may read earlier parts
    help: str


REGISTRY: dict[str, CollectorSpec] = {}


def register(
    name: str, *, order: int, help: str, default_enabled: bool = True
) -> Callable[[Callable[[ExporterConfig], Collector]], Callable[[ExporterConfig], Collector]]:
    def decorate(
        factory: Callable[[ExporterConfig], Collector],
    ) -> Callable[[ExporterConfig], Collector]:
        if name in REGISTRY:
            raise ValueError(f"collector {name!r} registered twice")
        REGISTRY[name] = CollectorSpec(name, factory, default_enabled, order, help)
        return factory

    return decorate


def enabled_specs(switches: dict[str, bool]) -> list[CollectorSpec]:
    unknown = set(switches) - set(REGISTRY)
    if unknown:
        raise ValueError(f"unknown collector(s) {sorted(unknown)}; known: {sorted(REGISTRY)}")
    specs = [s for s in REGISTRY.values() if switches.get(s.name, s.default_enabled)]
    return sorted(specs, key=lambda s: s.order)
