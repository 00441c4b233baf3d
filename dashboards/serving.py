"""Serving queues: what waits where, how long batches take to form, and who pays in latency."""

from __future__ import annotations

from typing import Any

from gpubalance.dashboards.common import finish, label_variable, new_dashboard, query, series

UID = "gpubalance-serving"
SERVING = 'instance=~"$host", queue=~"$pool", gpu=~"$gpu"'
LEGEND = "{{instance}} GPU {{gpu}} {{worker}}"


def _mean(name: str, by: str) -> str:
    """The mean of a summary over the rate interval: rate of its sum over rate of its count."""
    return (
        f"sum by ({by}) (rate({name}_sum{{{SERVING}}}[$__rate_interval])) "
        f"/ sum by ({by}) (rate({name}_count{{{SERVING}}}[$__rate_interval]))"
    )


def build() -> dict[str, Any]:
    per_worker = "instance, gpu, worker"
    board = (
        new_dashboard(
            UID,
            "gpubalance / Serving queues",
            "Queues, batches and latency per worker and GPU, as the exporter maps the serving "
            "stack's metrics (Triton, vLLM, TGI, SGLang, OTLP pushes) to GPUs.",
        )
        .with_variable(label_variable("host", "Host", "gpubalance_queue_depth", "instance"))
        .with_variable(
            label_variable("pool", "Pool", 'gpubalance_queue_depth{instance=~"$host"}', "queue")
        )
        .with_variable(
            label_variable(
                "gpu", "GPU", 'gpubalance_queue_depth{instance=~"$host"}', "gpu", numeric=True
            )
        )
        .with_panel(
            series(
                "Queue depth",
                "Requests waiting for a batch, per worker and GPU.",
                [query(f"sum by ({per_worker}) (gpubalance_queue_depth{{{SERVING}}})", LEGEND)],
                "short",
            )
        )
        .with_panel(
            series(
                "Running requests",
                "Requests in the batch on the GPU.",
                [
                    query(
                        f"sum by ({per_worker}) (gpubalance_batch_running_requests{{{SERVING}}})",
                        LEGEND,
                    )
                ],
                "short",
            )
        )
        .with_panel(
            series(
                "Batch-assembly delay",
                "Mean time from enqueue to the start of the request's batch: long while the "
                "GPU idles means the batcher waits to fill batches (max queue delay).",
                [query(_mean("gpubalance_batch_assembly_delay_seconds", per_worker), LEGEND)],
                "s",
            )
        )
        .with_panel(
            series(
                "Batch size",
                "Mean requests per batch.",
                [query(_mean("gpubalance_batch_size", per_worker), LEGEND)],
                "short",
            )
        )
        .with_panel(
            series(
                "Request latency per worker and GPU",
                "Mean time from arrival to answer (the exporter's summaries carry no "
                "quantiles; see the p99 panel for engines that export a histogram).",
                [query(_mean("gpubalance_request_duration_seconds", per_worker), LEGEND)],
                "s",
            )
        )
        .with_panel(
            series(
                "Request latency p99 (vLLM engines)",
                "99th percentile of end-to-end latency from vLLM's own histogram, scraped from "
                "each engine (vllm:e2e_request_latency_seconds); one line per engine target.",
                [
                    query(
                        "histogram_quantile(0.99, sum by (le, instance, model_name) "
                        "(rate(vllm:e2e_request_latency_seconds_bucket[$__rate_interval])))",
                        "{{instance}} {{model_name}}",
                    )
                ],
                "s",
            )
        )
        .with_panel(
            series(
                "Interactive against batch: latency",
                "Mean request latency by service class: interactive requests that share a "
                "queue with batch jobs inherit their latency.",
                [query(_mean("gpubalance_request_duration_seconds", "class"), "{{class}}")],
                "s",
            )
        )
        .with_panel(
            series(
                "Interactive against batch: throughput",
                "Requests completed per second by service class.",
                [
                    query(
                        "sum by (class) (rate(gpubalance_request_duration_seconds_count"
                        f"{{{SERVING}}}[$__rate_interval]))",
                        "{{class}}",
                    )
                ],
                "reqps",
            )
        )
        .with_panel(
            series(
                "Tokens per request",
                "Prompt and generated tokens per request answered, per GPU (servers that "
                "count tokens): prompts long against outputs make prefill-bound batches, "
                "whose time grows with their size.",
                [
                    query(
                        f"sum by ({per_worker}) (rate(gpubalance_{kind}_tokens_total"
                        f"{{{SERVING}}}[$__rate_interval])) / sum by ({per_worker}) "
                        "(rate(gpubalance_request_duration_seconds_count"
                        f"{{{SERVING}}}[$__rate_interval]))",
                        f"{LEGEND} {kind}",
                    )
                    for kind in ("prompt", "generation")
                ],
                "short",
            )
        )
        .with_panel(
            series(
                "KV cache usage",
                "Share of the KV cache in use (engines that report it).",
                [query(f"gpubalance_kv_cache_usage_ratio{{{SERVING}}}", LEGEND)],
                "percentunit",
                maximum=1,
            )
        )
        .with_panel(
            series(
                "Memory allocation failures",
                "Requests that failed to get GPU memory per second (OOM, preemptions, "
                "Triton BACKEND failures).",
                [
                    query(
                        f"sum by ({per_worker}) (rate(gpubalance_memory_allocation_failures_total"
                        f"{{{SERVING}}}[$__rate_interval]))",
                        LEGEND,
                    )
                ],
                "ops",
            )
        )
        .with_panel(
            series(
                "Serving sources",
                "1 when the last scrape or push of each serving source succeeded; stale "
                "sources' figures are not served as current.",
                [
                    query(
                        'gpubalance_serving_source_up{instance=~"$host"}',
                        "{{instance}} {{source}} up",
                    ),
                    query(
                        'gpubalance_serving_source_stale{instance=~"$host"}',
                        "{{instance}} {{source}} stale",
                    ),
                ],
                "short",
                maximum=1,
            )
        )
    )
    return finish(board)
