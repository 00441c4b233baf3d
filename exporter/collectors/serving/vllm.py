"""vLLM's ``/metrics`` (V1 engine, about v0.10) as one reading per ``(model_name, engine)``.

Source: ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``). Every engine metric carries
``model_name`` and ``engine``, the data-parallel engine index, which becomes ``rank``: the
engine's position among the endpoint's engines (with ``--tensor-parallel-size`` > 1 an engine
spans several GPUs; which ones is the configuration's business).

- ``queue_depth``: ``vllm:num_requests_waiting``; ``running``: ``vllm:num_requests_running``.
- ``kv_cache_usage_ratio``: ``vllm:kv_cache_usage_perc`` (0-1), or ``vllm:gpu_cache_usage_perc``,
  its name before 0.9, where the newer one is not served.
- ``batch_assembly_delay_seconds``: the ``vllm:request_queue_time_seconds`` histogram, time in
  the WAITING phase from arrival to first scheduling, observed when a request finishes.
- ``request_duration_seconds``: the ``vllm:e2e_request_latency_seconds`` histogram.
- ``allocation_failures_total``: ``vllm:num_preemptions`` (exposed as ``..._total``). The V1
  scheduler preempts a running request when it cannot allocate KV-cache blocks for the next
  step, so this counts KV allocation failures (one request can be preempted more than once).
- ``prompt_tokens_total``, ``generation_tokens_total``: the ``vllm:prompt_tokens`` and
  ``vllm:generation_tokens`` counters (prefilled prompt tokens, generated tokens).
- ``batch_size_*``: ``None``; vLLM has no per-batch request count (its
  ``vllm:iteration_tokens_total`` counts tokens per step, not requests).
"""

from __future__ import annotations

from prometheus_client.metrics_core import Metric

from gpubalance.exporter.collectors.serving.base import ServingReading
from gpubalance.exporter.collectors.serving.formats import (
    Field,
    histogram,
    index,
    key,
    register,
    rows,
)

FORMAT = "vllm"
FOLLOWS = "vLLM 0.10, V1 engine (vllm/v1/metrics/loggers.py)"

_FIELDS: tuple[Field, ...] = (
    ("queue_depth", "vllm:num_requests_waiting", "gauge", ""),
    ("running", "vllm:num_requests_running", "gauge", ""),
    ("kv_cache_usage_ratio", "vllm:gpu_cache_usage_perc", "gauge", ""),  # the name before 0.9
    ("kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", "gauge", ""),
    ("allocation_failures_total", "vllm:num_preemptions", "counter", ""),
    ("prompt_tokens_total", "vllm:prompt_tokens", "counter", ""),
    ("generation_tokens_total", "vllm:generation_tokens", "counter", ""),
    *histogram("batch_assembly_delay_seconds", "vllm:request_queue_time_seconds"),
    *histogram("request_duration_seconds", "vllm:e2e_request_latency_seconds"),
)


@register(FORMAT)
def parse(families: dict[str, Metric]) -> list[ServingReading]:
    """One reading per ``(model_name, engine)`` label set, ordered by key."""
    readings = [
        ServingReading(key=key(labels), rank=index(dict(labels).get("engine")), **row)
        for labels, row in rows(families, _FIELDS).items()
    ]
    return sorted(readings, key=lambda r: r.key)
