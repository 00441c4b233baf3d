"""Collectors, one per file; importing this package registers them all."""

from gpubalance.exporter.collectors import gpu, host, processes
from gpubalance.exporter.collectors.base import REGISTRY, CollectorSpec, enabled_specs

__all__ = ["REGISTRY", "CollectorSpec", "enabled_specs", "gpu", "host", "processes"]
