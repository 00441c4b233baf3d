"""Collectors, one per file; importing this package registers them all."""

from gpubalance.exporter.collectors import gpu, host, processes
from gpubalance.exporter.collectors.base import REGISTRY, CollectorSpec, enabled_specs
from gpubalance.exporter.collectors.serving import collector as serving

__all__ = ["REGISTRY", "CollectorSpec", "enabled_specs", "gpu", "host", "processes", "serving"]
