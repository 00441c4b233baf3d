"""The lab's live workers serve vLLM's, Triton's and TGI's formats (lab/live/formats.py): the
adapters read back what a worker holds."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from gpubalance.exporter.collectors.serving.base import ServingReading
from gpubalance.exporter.collectors.serving.formats import read
from gpubalance.lab.live.formats import render_metrics
from gpubalance.lab.live.worker import LATENCY_BUCKETS, Histogram

GPU = "GPU-00000002-aaaa-bbbb-cccc-000000000002"


def worker() -> SimpleNamespace:
    """What render_metrics reads of a Worker, after some traffic."""
    queue_time, latency = Histogram(LATENCY_BUCKETS), Histogram(LATENCY_BUCKETS)
    for seconds in (0.004, 0.03, 0.2, 0.2, 1.7, 12.0):
        queue_time.observe(seconds)
    for seconds in (0.3, 0.45, 0.9, 2.2, 3.1):
        latency.observe(seconds)
    return SimpleNamespace(
        config=SimpleNamespace(model_name="llama-8b", gpu_uuid=GPU, kv_cache_bytes=8 << 30),
        kv=SimpleNamespace(used_bytes=3 << 30),
        queue=deque([object()] * 5),
        running=3,
        allocation_failures=2,
        prompt_tokens=2310,  # of the 5 completed requests
        generation_tokens=412,
        rejected=1,
        requests_done=latency.count,
        request_duration_sum=latency.sum,
        batches=4,
        batch_size_sum=9.0,
        busy_seconds=6.25,
        queue_time=queue_time,
        queue_done_seconds=1.9,  # the queue time of the 5 completed requests
        latency=latency,
    )


def test_vllm_format_reads_back() -> None:
    w = worker()
    assert read("vllm", render_metrics("vllm", w)) == [
        ServingReading(
            key="engine=0,model_name=llama-8b",
            rank=0,
            queue_depth=5.0,
            running=3.0,
            batch_assembly_delay_seconds_sum=w.queue_time.sum,
            batch_assembly_delay_seconds_count=6.0,
            request_duration_seconds_sum=w.latency.sum,
            request_duration_seconds_count=5.0,
            allocation_failures_total=2.0,
            kv_cache_usage_ratio=0.375,
            prompt_tokens_total=2310.0,
            generation_tokens_total=412.0,
        )
    ]


def test_triton_format_reads_back() -> None:
    w = worker()
    (reading,) = read("triton", render_metrics("triton", w))
    # Triton counts the queue time of completed requests (the worker keeps seconds, Triton
    # whole microseconds), so sum and count describe the same requests
    assert reading.batch_assembly_delay_seconds_sum == pytest.approx(1.9, abs=1e-6)
    assert reading.request_duration_seconds_sum == pytest.approx(w.latency.sum, abs=1e-6)
    assert reading == ServingReading(
        key=f"model=llama-8b,version=1,gpu_uuid={GPU}",
        gpu_uuid=GPU,
        queue_depth=5.0,
        batch_assembly_delay_seconds_sum=reading.batch_assembly_delay_seconds_sum,
        batch_assembly_delay_seconds_count=5.0,  # Triton's count: successful requests
        batch_size_sum=9.0,
        batch_size_count=4.0,
        request_duration_seconds_sum=reading.request_duration_seconds_sum,
        request_duration_seconds_count=5.0,
        allocation_failures_total=2.0,
    )


def test_tgi_format_reads_back() -> None:
    w = worker()
    assert read("tgi", render_metrics("tgi", w)) == [
        ServingReading(
            key="router",
            queue_depth=5.0,
            running=3.0,
            batch_assembly_delay_seconds_sum=w.queue_time.sum,
            batch_assembly_delay_seconds_count=6.0,
            batch_size_sum=9.0,  # the batch sizes that idle-while-queued's batch fill needs
            batch_size_count=4.0,
            request_duration_seconds_sum=w.latency.sum,
            request_duration_seconds_count=5.0,
            prompt_tokens_total=2310.0,
            generation_tokens_total=412.0,
        )
    ]
