"""What the sampler publishes after each sample, and every reader (scrape, snapshot) serves."""

from __future__ import annotations

from dataclasses import dataclass

from gpubalance.telemetry import Sample, Window


@dataclass(frozen=True, slots=True)
class View:
    generation: int  # increases by one per sample: renderers cache by it
    sample: Sample
    window: Window
    samples_total: int
    overruns_total: int  # samples that took longer than the interval
    interval_seconds: float
    window_seconds: float
    trend_window_seconds: float
