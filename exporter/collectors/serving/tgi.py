"""Text Generation Inference's ``/metrics`` as its one queue's reading.

Sources: ``docs/source/reference/metrics.md``, ``router/src/server.rs`` (histogram buckets,
observations at request completion), ``backends/v3/src/queue.rs`` and ``backend.rs`` (queue and
batch). TGI has one queue, in its router, in front of all its shards, and labels none of these
series: the reading's key is ``router``, and the shards' GPUs come from the configuration.

- ``queue_depth``: ``tgi_queue_size``; ``running``: ``tgi_batch_current_size``.
- ``batch_assembly_delay_seconds``: the ``tgi_request_queue_duration`` histogram, from a
  request's arrival in the queue to the batch that takes it (observed for successful requests).
- ``request_duration_seconds``: the ``tgi_request_duration`` histogram (successful requests).
- ``batch_size_*``: the ``tgi_batch_next_size`` histogram: requests per new batch the queue
  hands to the shards. With continuous batching these join the running batch, so this is the
  admission batch size; the running batch's size is ``running``.
- ``prompt_tokens_total``, ``generation_tokens_total``: the sums of the
  ``tgi_request_input_length`` and ``tgi_request_generated_tokens`` histograms (observed per
  successful request, at its end).
- ``allocation_failures_total``, ``kv_cache_usage_ratio``: ``None``. When the block allocator
  is full the request stays queued, and TGI counts nothing for it.
"""

from __future__ import annotations

from prometheus_client.metrics_core import Metric

from gpubalance.exporter.collectors.serving.base import ServingReading
from gpubalance.exporter.collectors.serving.formats import Field, histogram, register, rows

FORMAT = "tgi"
FOLLOWS = "text-generation-inference 3.x (db931fc: router/src/server.rs, backends/v3/src/queue.rs)"
KEY = "router"

_FIELDS: tuple[Field, ...] = (
    ("queue_depth", "tgi_queue_size", "gauge", ""),
    ("running", "tgi_batch_current_size", "gauge", ""),
    *histogram("batch_assembly_delay_seconds", "tgi_request_queue_duration"),
    *histogram("batch_size", "tgi_batch_next_size"),
    *histogram("request_duration_seconds", "tgi_request_duration"),
    ("prompt_tokens_total", "tgi_request_input_length", "histogram", "_sum"),
    ("generation_tokens_total", "tgi_request_generated_tokens", "histogram", "_sum"),
)


@register(FORMAT)
def parse(families: dict[str, Metric]) -> list[ServingReading]:
    """The router queue's reading, from the unlabelled series; none if TGI reported nothing."""
    row = rows(families, _FIELDS).get(())
    return [ServingReading(key=KEY, **row)] if row else []
