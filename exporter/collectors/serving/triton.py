"""Triton Inference Server's ``/metrics`` as one reading per model instance group on a GPU.

Sources: ``server docs/user_guide/metrics.md``; ``core src/metrics.cc``,
``src/metric_model_reporter.cc``, ``src/backend_model_instance.cc``. Counters are written by
prometheus-cpp without ``_total`` (both spellings are read). Series carry ``model``,
``version``, ``namespace`` with model namespacing, ``_<tag>`` per ``metric_tags`` entry, and
``gpu_uuid`` on the execution metrics of a KIND_GPU instance. A reading is one model (all those
labels) on one GPU; a model without GPU series (KIND_CPU) gets one reading without a GPU.

- ``batch_size_sum`` / ``_count``: ``nv_inference_count`` / ``nv_inference_exec_count``, whose
  ratio is Triton's documented average batch size.
- ``batch_assembly_delay_seconds_sum``: ``nv_inference_queue_duration_us`` / 1e6: from arrival
  in the model's scheduler queue (dynamic-batcher wait included) to the start of execution.
- ``request_duration_seconds_sum``: ``nv_inference_request_duration_us`` / 1e6.
- both ``_count`` fields: ``nv_inference_request_success``: Triton adds to both durations per
  successful request (cache hits included, as in the durations).
- ``queue_depth``: ``nv_inference_pending_request_count``. The model-level reporter writes it
  without ``gpu_uuid``: one queue feeds all of a model's instances (whichever frees first takes
  the next batch), so each GPU reading of the model gets an equal share, and the shares add up
  to the model's queue. A model without GPU readings keeps it whole.
- ``allocation_failures_total``: ``nv_inference_request_failure{reason="BACKEND"}``: every
  error the backend returns while executing, of which running out of GPU memory is one. An
  approximation: Triton does not count allocation failures apart. Triton before the ``reason``
  label (core PR #377, July 2024; releases before about 24.07) counts all failures in one
  series without it, which is taken whole: the best figure such a server gives.
- ``running``, ``kv_cache_usage_ratio``: ``None`` from Triton core, which exports neither.

The TensorRT-LLM backend queues inside TensorRT-LLM: Triton hands it each request at once, so
the pending count stays near 0 however long the queue. Its own gauges, one series per
``request_type`` or ``kv_cache_block_type`` next to ``model`` and ``version`` (backend
``custom_metrics_reporter.cc``; ``waiting`` only in newer backends: there at NVIDIA/TensorRT-LLM
89fd9b7, not at triton-inference-server/tensorrtllm_backend 7f9aa46), fill in:

- ``queue_depth``: plus ``nv_trt_llm_request_metrics{request_type="waiting"}``, the requests in
  TensorRT-LLM's executor queue not yet taken into a batch (``numQueuedRequests``).
- ``running``: ``nv_trt_llm_request_metrics{request_type="active"}``, the requests the batch
  manager holds, in context or generation (``numActiveRequests``).
- ``kv_cache_usage_ratio``: ``nv_trt_llm_kv_cache_block_metrics`` ``used`` / ``max`` blocks.

A ``tensorrt_llm`` model runs as a KIND_CPU instance (the backend places its engine on the GPUs
itself), so its reading names no GPU; the configuration maps it.
"""

from __future__ import annotations

from prometheus_client.metrics_core import Metric

from gpubalance.exporter.collectors.serving.base import ServingReading
from gpubalance.exporter.collectors.serving.formats import Labels, key, register, values

FORMAT = "triton"
FOLLOWS = (
    "Triton Inference Server 2.x (core 73aad7c: src/metrics.cc, src/metric_model_reporter.cc); "
    "TensorRT-LLM backend (NVIDIA/TensorRT-LLM 89fd9b7: triton_backend/inflight_batcher_llm/src/"
    "custom_metrics_reporter/custom_metrics_reporter.cc)"
)

# A model instance group: the model's labels, and the GPU's UUID (None: no GPU named).
Instance = tuple[Labels, str | None]

# (reading field, counter, divisor to the field's unit)
_COUNTERS = (
    ("batch_size_sum", "nv_inference_count", 1.0),
    ("batch_size_count", "nv_inference_exec_count", 1.0),
    ("batch_assembly_delay_seconds_sum", "nv_inference_queue_duration_us", 1e6),
    ("batch_assembly_delay_seconds_count", "nv_inference_request_success", 1.0),
    ("request_duration_seconds_sum", "nv_inference_request_duration_us", 1e6),
    ("request_duration_seconds_count", "nv_inference_request_success", 1.0),
)


@register(FORMAT)
def parse(families: dict[str, Metric]) -> list[ServingReading]:
    """One reading per (model, GPU), ordered by key."""
    found: dict[Instance, dict[str, float]] = {}
    for field, name, divisor in _COUNTERS:
        for labels, value in values(families, name, "counter").items():
            found.setdefault(_instance(labels), {})[field] = value / divisor
    for labels, value in values(families, "nv_inference_request_failure", "counter").items():
        # no reason (Triton before them, or an empty label, which is none): all failures
        if dict(labels).get("reason") in (None, "", "BACKEND"):
            found.setdefault(_instance(labels), {})["allocation_failures_total"] = value
    gpus: dict[Labels, list[Instance]] = {}
    for model, gpu in found:
        if gpu is not None:
            gpus.setdefault(model, []).append((model, gpu))
    for labels, value in values(families, "nv_inference_pending_request_count", "gauge").items():
        model, gpu = _instance(labels)
        shares = [(model, gpu)] if gpu is not None else gpus.get(model, [(model, None)])
        for instance in shares:
            found.setdefault(instance, {})["queue_depth"] = value / len(shares)
    requests = _by_type(families, "nv_trt_llm_request_metrics", "request_type")
    blocks = _by_type(families, "nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type")
    for model in requests.keys() | blocks.keys():
        # shared like the pending count, should a model with GPU instances report them
        shares = gpus.get(model, [(model, None)])
        request, block = requests.get(model, {}), blocks.get(model, {})
        waiting, active = request.get("waiting"), request.get("active")
        used, total = block.get("used"), block.get("max")
        for instance in shares:
            row = found.setdefault(instance, {})
            if waiting is not None:
                row["queue_depth"] = row.get("queue_depth", 0.0) + waiting / len(shares)
            if active is not None:
                row["running"] = active / len(shares)
            if used is not None and total:
                row["kv_cache_usage_ratio"] = used / total
    readings = [
        ServingReading(key=key(model + ((("gpu_uuid", gpu),) if gpu else ())), gpu_uuid=gpu, **row)
        for (model, gpu), row in found.items()
    ]
    return sorted(readings, key=lambda r: r.key)


def _by_type(families: dict[str, Metric], name: str, label: str) -> dict[Labels, dict[str, float]]:
    """A TensorRT-LLM gauge family's values by model labels, then by its ``label``'s value."""
    found: dict[Labels, dict[str, float]] = {}
    for labels, value in values(families, name, "gauge").items():
        kind = dict(labels).get(label)
        if kind is not None:
            model, _ = _instance(tuple((n, v) for n, v in labels if n != label))
            found.setdefault(model, {})[kind] = value
    return found


def _instance(labels: Labels) -> Instance:
    """The model's labels (without the per-sample ``reason``) and the GPU, apart; an empty
    ``gpu_uuid`` is no label, as in Prometheus."""
    model = tuple((n, v) for n, v in labels if n not in ("gpu_uuid", "reason"))
    return model, dict(labels).get("gpu_uuid") or None
