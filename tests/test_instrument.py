"""gpubalance.instrument.ServingMetrics pushing to an OTLP receiver on the exporter's OTLP
runner, and the example worker built on it."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from aiohttp import web
from opentelemetry.metrics import get_meter_provider

from gpubalance.exporter.collectors.serving.base import ServingReading
from gpubalance.exporter.collectors.serving.store import ServingStore
from gpubalance.exporter.otlp import OtlpReceiver, otlp_runner
from gpubalance.instrument import EXPORT_TIMEOUT_SECONDS, ServingMetrics

ROOT = Path(__file__).resolve().parents[1]
HOUR = 3600.0  # an export interval that never fires during a test: pushes come from flushes


class Receiver:
    """An OtlpReceiver at POST /v1/metrics on 127.0.0.1 (a free port), served from a thread of
    its own."""

    def __init__(self) -> None:
        self.store = ServingStore()
        self._loop = asyncio.new_event_loop()
        self._runner = otlp_runner(OtlpReceiver(self.store))
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(10)
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", 0).start())
        started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def readings(self) -> dict[str, ServingReading]:
        return {stored.reading.key: stored.reading for stored in self.store.readings()}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    running = Receiver()
    yield running
    running.stop()


def test_values_arrive_with_the_worker_and_gpu(receiver: Receiver) -> None:
    metrics = ServingMetrics(
        f"{receiver.url}/v1/metrics",
        worker="w1",
        gpu_uuid="GPU-1",
        gpu_index=1,
        service_class="chat",
        export_interval_seconds=HOUR,
    )
    metrics.set_queue_depth(5)
    metrics.batch_started([0.01, 0.01, 0.02, 0.0])  # four requests, each with its wait
    metrics.batch_started([0.03, 0.01])
    metrics.request_finished(0.2, tenant="acme", prompt_tokens=900, generated_tokens=12)
    metrics.request_finished(0.4, tenant="acme", prompt_tokens=300, generated_tokens=40)
    metrics.allocation_failed()
    metrics.allocation_failed()
    assert metrics.flush()
    metrics.set_queue_depth(3)  # a gauge: the next push replaces the depth
    assert metrics.flush()
    metrics.shutdown()

    readings = receiver.readings()
    worker = readings["worker=w1,class=chat,gpu_uuid=GPU-1,gpu_index=1"]
    assert worker.queue_depth == 3
    assert worker.batch_assembly_delay_seconds_sum == pytest.approx(0.08)
    assert worker.batch_assembly_delay_seconds_count == 6  # per request, as Triton and vLLM
    assert (worker.batch_size_sum, worker.batch_size_count) == (6, 2)
    assert worker.allocation_failures_total == 2
    acme = readings["worker=w1,class=chat,tenant=acme,gpu_uuid=GPU-1,gpu_index=1"]
    assert acme.request_duration_seconds_sum == pytest.approx(0.6)
    assert acme.request_duration_seconds_count == 2
    # the requests' tokens, with their tenant
    assert (acme.prompt_tokens_total, acme.generation_tokens_total) == (1200, 52)
    assert worker.prompt_tokens_total is None
    assert set(readings) == {worker.key, acme.key}
    (status,) = receiver.store.statuses()
    assert status.up and not status.errors_total


def test_it_leaves_the_global_meter_provider_alone(receiver: Receiver) -> None:
    before = get_meter_provider()
    with ServingMetrics(f"{receiver.url}/v1/metrics", export_interval_seconds=HOUR) as metrics:
        metrics.set_queue_depth(1)
    assert get_meter_provider() is before
    assert metrics._provider is not before


def test_shutdown_and_the_with_block_push_what_is_left(receiver: Receiver) -> None:
    with ServingMetrics(
        f"{receiver.url}/v1/metrics", worker="w2", export_interval_seconds=HOUR
    ) as metrics:
        metrics.set_queue_depth(2)
        metrics.batch_started([0.002] * 8)
    metrics.shutdown()  # a second time does nothing
    reading = receiver.readings()["worker=w2"]
    assert (reading.queue_depth, reading.batch_size_sum) == (2, 8)


def test_a_dead_exporter_does_not_hold_shutdown_for_long() -> None:
    receiver = Receiver()
    receiver.stop()  # its port is now closed
    metrics = ServingMetrics(f"{receiver.url}/v1/metrics", export_interval_seconds=HOUR)
    metrics.set_queue_depth(1)
    started = time.monotonic()
    metrics.shutdown()
    assert time.monotonic() - started < EXPORT_TIMEOUT_SECONDS + 2


def test_the_example_worker_serves_batches_and_pushes(receiver: Receiver) -> None:
    worker = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "docs" / "examples" / "otlp_worker.py"),
            "--exporter",
            receiver.url,
            "--port",
            "0",
            "--gpu",
            "3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert worker.stdout is not None
        line = worker.stdout.readline()
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line + worker.stdout.read()

        def infer(i: int) -> bytes:
            call = urllib.request.Request(
                f"{match.group(1)}/infer", data=b"x", headers={"X-Tenant": f"t{i % 2}"}
            )
            with urllib.request.urlopen(call, timeout=10) as response:
                return response.read()

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(infer, range(48)))
        assert all(b"batch_size" in answer for answer in answers)
    finally:
        worker.send_signal(signal.SIGTERM)
        output = worker.communicate(timeout=20)[0]
    assert worker.returncode == 0, output

    readings = receiver.readings()
    base = readings["worker=example-worker,gpu_index=3"]
    assert base.batch_size_sum == 48 and base.batch_size_count <= 48
    assert base.batch_assembly_delay_seconds_count == base.batch_size_sum  # one per request
    assert base.queue_depth is not None
    tenants = [readings[f"worker=example-worker,tenant=t{i},gpu_index=3"] for i in (0, 1)]
    assert sum(t.request_duration_seconds_count for t in tenants) == 48
