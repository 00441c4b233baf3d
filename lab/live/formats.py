"""The live workers' /metrics, in the exposition formats of real serving stacks.

- ``vllm``: vLLM's V1 engine metrics (``vllm/v1/metrics/loggers.py``, about v0.10): labels
  ``model_name`` and ``engine``; counters end in ``_total``.
- ``triton``: Triton Inference Server 2.x (``docs/user_guide/metrics.md``): labels ``model`` and
  ``version``; execution metrics of a GPU instance also carry ``gpu_uuid``; latencies are
  cumulative microsecond counters; avg batch size is inference count / execution count.
- ``tgi``: Text Generation Inference 3.x (``router/src/server.rs``): one unlabelled router
  queue, with histograms of request latency, queue time, the size of each new batch and the
  requests' input and generated token counts (the lab's has only the +Inf bucket of the last
  three: their sums and counts are what the exporter reads).

The names, types and labels follow those servers, so the exporter's serving adapters parse a
lab worker as they parse the real thing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gpubalance.exporter.exposition.text import Exposition, format_value

G, C, H = "gauge", "counter", "histogram"


class _Histogram(Protocol):
    @property
    def buckets(self) -> tuple[float, ...]: ...
    @property
    def counts(self) -> Sequence[int]: ...
    @property
    def sum(self) -> float: ...
    @property
    def count(self) -> int: ...


def _histogram(
    out: Exposition, name: str, help_text: str, h: _Histogram, labels: dict[str, str]
) -> None:
    out.add(name, H, help_text, None)
    for bound, count in zip(h.buckets, h.counts, strict=True):
        out.add(name, H, "", count, {**labels, "le": format_value(bound)}, f"{name}_bucket")
    out.add(name, H, "", h.count, {**labels, "le": "+Inf"}, f"{name}_bucket")
    out.add(name, H, "", h.sum, labels, f"{name}_sum")
    out.add(name, H, "", h.count, labels, f"{name}_count")


def vllm(worker: Any) -> Exposition:
    out = Exposition()
    labels = {"model_name": worker.config.model_name, "engine": "0"}
    out.add(
        "vllm:num_requests_running",
        G,
        "Number of requests in model execution batches.",
        worker.running,
        labels,
    )
    out.add(
        "vllm:num_requests_waiting",
        G,
        "Number of requests waiting to be processed.",
        len(worker.queue),
        labels,
    )
    capacity = worker.config.kv_cache_bytes
    out.add(
        "vllm:kv_cache_usage_perc",
        G,
        "KV-cache usage. 1 means 100 percent usage.",
        worker.kv.used_bytes / capacity if capacity else 0.0,
        labels,
    )
    out.add(
        "vllm:num_preemptions_total",
        C,
        "Cumulative number of preemption from the engine.",
        worker.allocation_failures,
        labels,
    )
    out.add(
        "vllm:prompt_tokens_total",
        C,
        "Number of prefill tokens processed.",
        worker.prompt_tokens,
        labels,
    )
    out.add(
        "vllm:generation_tokens_total",
        C,
        "Number of generation tokens processed.",
        worker.generation_tokens,
        labels,
    )
    out.add(
        "vllm:request_success_total",
        C,
        "Count of successfully processed requests.",
        worker.requests_done,
        {**labels, "finished_reason": "stop"},
    )
    _histogram(
        out,
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        worker.queue_time,
        labels,
    )
    _histogram(
        out,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        worker.latency,
        labels,
    )
    return out


def triton(worker: Any) -> Exposition:
    out = Exposition()
    model = {"model": worker.config.model_name, "version": "1"}
    instance = {**model, "gpu_uuid": worker.config.gpu_uuid}
    out.add(
        "nv_inference_request_success",
        C,
        "Number of successful inference requests, all batch sizes",
        worker.requests_done,
        instance,
    )
    for reason, value in (
        ("REJECTED", worker.rejected),
        ("CANCELED", 0),
        ("BACKEND", worker.allocation_failures),
        ("OTHER", 0),
    ):
        out.add(
            "nv_inference_request_failure",
            C,
            "Number of failed inference requests, all batch sizes",
            value,
            {**instance, "reason": reason},
        )
    out.add(
        "nv_inference_count",
        C,
        "Number of inferences performed (does not include cached requests)",
        worker.batch_size_sum,
        instance,
    )
    out.add(
        "nv_inference_exec_count",
        C,
        "Number of model executions performed (does not include cached requests)",
        worker.batches,
        instance,
    )
    out.add(
        "nv_inference_request_duration_us",
        C,
        "Cumulative inference request duration in microseconds (includes cached requests)",
        round(worker.request_duration_sum * 1e6),
        instance,
    )
    out.add(
        "nv_inference_queue_duration_us",
        C,
        "Cumulative inference queuing duration in microseconds (includes cached requests)",
        round(worker.queue_done_seconds * 1e6),
        instance,
    )
    out.add(
        "nv_inference_compute_infer_duration_us",
        C,
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
        round(worker.busy_seconds * 1e6),
        instance,
    )
    out.add(
        "nv_inference_pending_request_count",
        G,
        "Instantaneous number of pending requests awaiting execution per-model.",
        len(worker.queue),
        model,
    )
    return out


@dataclass(frozen=True, slots=True)
class _Totals:
    """A histogram known by its sum and count only."""

    sum: float
    count: int
    buckets: tuple[float, ...] = ()
    counts: tuple[int, ...] = ()


def tgi(worker: Any) -> Exposition:
    out = Exposition()
    out.add("tgi_queue_size", G, "Current queue size", len(worker.queue), {})
    out.add("tgi_batch_current_size", G, "Current batch size", worker.running, {})
    _histogram(out, "tgi_request_duration", "Request duration", worker.latency, {})
    _histogram(out, "tgi_request_queue_duration", "Time spent in the queue", worker.queue_time, {})
    batches = _Totals(worker.batch_size_sum, worker.batches)
    _histogram(out, "tgi_batch_next_size", "Batch size of the next batch", batches, {})
    prompts = _Totals(worker.prompt_tokens, worker.requests_done)
    _histogram(out, "tgi_request_input_length", "Input token count per request", prompts, {})
    outputs = _Totals(worker.generation_tokens, worker.requests_done)
    _histogram(out, "tgi_request_generated_tokens", "Generated tokens per request", outputs, {})
    return out


# an OTLP-pushing worker still answers /metrics (nobody scrapes it): in vLLM's format
FORMATS = {"vllm": vllm, "triton": triton, "tgi": tgi, "otlp": vllm}


def render_metrics(name: str, worker: Any) -> str:
    return FORMATS[name](worker).render().decode()
