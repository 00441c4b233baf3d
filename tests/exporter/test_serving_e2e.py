"""Serving signals end to end: serving endpoints scraped by the exporter process, mapped to
GPUs (configured, Triton's gpu_uuid, or the process listening on the port), a slow and a dead
endpoint that delay nothing, a source that goes stale, and OTLP pushes to the exporter's own
OTLP listener (TLS and a token beyond loopback)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web
from harness import Metrics, RunningExporter

from gpubalance.exporter.config import ExporterConfig
from gpubalance.instrument import DEFAULT_ENDPOINT, ServingMetrics

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama-8b"} 6.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama-8b"} 17.0
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="1.0",model_name="llama-8b"} 90.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="llama-8b"} 100.0
vllm:request_queue_time_seconds_count{engine="0",model_name="llama-8b"} 100.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="llama-8b"} 25.0
"""

TRITON = """\
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="resnet",version="1"} 3
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="resnet",version="1",gpu_uuid="GPU-00000003-aaaa-bbbb-cccc-000000000003"} 200
# HELP nv_inference_queue_duration_us Cumulative inference queuing duration in microseconds
# TYPE nv_inference_queue_duration_us counter
nv_inference_queue_duration_us{model="resnet",version="1",gpu_uuid="GPU-00000003-aaaa-bbbb-cccc-000000000003"} 4000000
"""  # noqa: E501


class Endpoints:
    """Fake serving servers in a thread of the test process: its PID listens on their ports."""

    def __init__(self) -> None:
        self.texts = {"vllm": VLLM, "vllm-auto": VLLM, "triton": TRITON}
        self.broken: set[str] = set()
        self.loop = asyncio.new_event_loop()
        self.ports: dict[str, int] = {}
        self.runners: list[web.AppRunner] = []
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self._ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        for name in (*self.texts, "slow"):
            app = web.Application()
            app.router.add_get("/metrics", self._handler(name))
            runner = web.AppRunner(app, shutdown_timeout=0.1)
            await runner.setup()
            self.runners.append(runner)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.ports[name] = runner.addresses[0][1]

    def _handler(self, name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            if name == "slow":
                await asyncio.sleep(30)
            if name in self.broken:
                return web.Response(status=500, text="boom")
            return web.Response(text=self.texts[name])

        return handle

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}/metrics"

    def __enter__(self) -> Endpoints:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            for runner in self.runners:
                await runner.cleanup()
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture
def endpoints() -> Iterator[Endpoints]:
    with Endpoints() as e:
        yield e


def state(gpus: int = 4) -> dict[str, object]:
    s: dict[str, object] = {"device_count": gpus}
    for i in range(gpus):
        s[f"gpu{i}.uuid"] = f"GPU-0000000{i}-aaaa-bbbb-cccc-00000000000{i}"
    # this test process serves the "vllm-auto" endpoint and holds GPU 1
    s["gpu1.procs"] = [(os.getpid(), 1 << 30)]
    return s


def config(tmp_path: Path, endpoints: Endpoints, stale_after: float = 3.0) -> Path:
    path = tmp_path / "gpubalance.yaml"
    path.write_text(f"""\
exporter:
  serving:
    scrape_interval: 0.2
    timeout: 0.5
    stale_after: {stale_after}
    endpoints:
      - {{url: "{endpoints.url("vllm")}", format: vllm, worker: vllm-0, gpu: 0, class: chat,
         max_batch_size: 48}}
      - {{url: "{endpoints.url("vllm-auto")}", format: vllm, worker: vllm-auto}}
      - {{url: "{endpoints.url("triton")}", format: triton, worker: triton-0}}
      - {{url: "{endpoints.url("slow")}", format: tgi, worker: slow}}
      - {{url: "http://127.0.0.1:9/metrics", format: sglang, worker: dead}}
""")
    return path


def test_queues_are_mapped_to_their_gpus(start_exporter, endpoints, tmp_path) -> None:
    exporter = start_exporter(state(), "--config", str(config(tmp_path, endpoints)))
    m = exporter.wait_for(lambda m: len(m.find("gpubalance_queue_depth")) == 3)
    # configured: GPU 0, with its class
    assert m.value("gpubalance_queue_depth", worker="vllm-0", gpu="0", **{"class": "chat"}) == 17
    assert m.value("gpubalance_batch_running_requests", worker="vllm-0") == 6
    assert m.value("gpubalance_batch_assembly_delay_seconds_sum", worker="vllm-0") == 25
    assert m.value("gpubalance_batch_assembly_delay_seconds_count", worker="vllm-0") == 100
    # the batch limit no serving stack exports, from the endpoint's configuration
    assert m.value("gpubalance_batch_size_limit", worker="vllm-0") == 48
    assert not m.has("gpubalance_batch_size_limit", worker="vllm-auto")
    # found from the process listening on the port: this test process, which holds GPU 1
    assert m.value("gpubalance_queue_depth", worker="vllm-auto", gpu="1") == 17
    # Triton names its GPU
    assert (
        m.value(
            "gpubalance_queue_depth",
            worker="triton-0",
            gpu="3",
            uuid="GPU-00000003-aaaa-bbbb-cccc-000000000003",
        )
        == 3
    )
    assert m.value("gpubalance_batch_assembly_delay_seconds_sum", worker="triton-0") == 4.0
    if shutil.which("promtool"):  # the serving families are valid exposition, lint-clean
        result = subprocess.run(
            ["promtool", "check", "metrics"],
            input=m.text,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stdout + result.stderr
    snapshot = exporter.snapshot()
    by_worker = {s["worker"]: s for s in snapshot["sample"]["serving"]}
    assert by_worker["vllm-auto"]["gpu_index"] == 1
    assert by_worker["vllm-0"]["queue_depth"] == 17


@pytest.mark.timing
def test_slow_and_dead_endpoints_delay_nothing_and_show(
    start_exporter, endpoints, tmp_path
) -> None:
    exporter = start_exporter(state(), "--config", str(config(tmp_path, endpoints)))

    def slow_timed_out_twice_while_vllm_answers(m: Metrics) -> bool:
        # on a loaded machine a scrape of the quick endpoint can miss the 0.5 s timeout too:
        # wait for a moment that shows both, as a scrape does once the CPU is there for it
        if not m.has("gpubalance_serving_source_errors_total", endpoint=endpoints.url("slow")):
            return False
        timeouts = m.value(
            "gpubalance_serving_source_errors_total",
            endpoint=endpoints.url("slow"),
            reason="timeout",
        )
        return (
            timeouts >= 2
            and m.value("gpubalance_serving_source_up", endpoint=endpoints.url("vllm")) == 1
        )

    m = exporter.wait_for(slow_timed_out_twice_while_vllm_answers, timeout=30)
    for url, up in (
        (endpoints.url("slow"), 0),
        ("http://127.0.0.1:9/metrics", 0),
        (endpoints.url("vllm"), 1),
    ):
        assert m.value("gpubalance_serving_source_up", endpoint=url) == up
        assert m.value("gpubalance_serving_source_stale", endpoint=url) == 1 - up
    assert (
        m.value(
            "gpubalance_serving_source_errors_total",
            endpoint="http://127.0.0.1:9/metrics",
            reason="unreachable",
        )
        >= 1
    )
    requests = "gpubalance_serving_source_requests_total"
    assert m.value(requests, endpoint=endpoints.url("slow"), outcome="timeout") >= 2
    assert not m.has(requests, endpoint=endpoints.url("slow"), outcome="ok")
    assert m.value(requests, endpoint=endpoints.url("vllm"), outcome="ok") >= 1
    # samples keep coming although the slow endpoint never answers, and none of them waits for
    # it: each takes less than the scrape's 0.5 s timeout
    first = m.value("gpubalance_exporter_samples_total")
    exporter.wait_for(lambda m: m.value("gpubalance_exporter_samples_total") >= first + 6)
    status, body = exporter.get("/api/v1/snapshot?history=6")
    assert status == 200, body
    snapshot = json.loads(body)
    took = [s["duration_seconds"] for s in (*snapshot["history"], snapshot["sample"])]
    assert len(took) == 7 and max(took) < 0.5, took


def test_a_stale_source_is_not_served_as_current(start_exporter, endpoints, tmp_path) -> None:
    exporter = start_exporter(state(), "--config", str(config(tmp_path, endpoints, 1.0)))
    exporter.wait_for(lambda m: m.has("gpubalance_queue_depth", worker="vllm-0"))
    endpoints.broken.add("vllm")
    m = exporter.wait_for(lambda m: not m.has("gpubalance_queue_depth", worker="vllm-0"))
    assert m.value("gpubalance_serving_source_stale", endpoint=endpoints.url("vllm")) == 1
    assert (
        m.value(
            "gpubalance_serving_source_errors_total",
            endpoint=endpoints.url("vllm"),
            reason="http_500",
        )
        >= 1
    )
    assert m.has("gpubalance_queue_depth", worker="vllm-auto")  # the others go on
    endpoints.broken.clear()
    exporter.wait_for(lambda m: m.has("gpubalance_queue_depth", worker="vllm-0"))


def test_opentelemetry_sdk_push_lands_on_the_right_gpu(start_exporter, tmp_path) -> None:
    """A real MeterProvider with the OTLP/HTTP exporter pushes to a running exporter."""
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    exporter = start_exporter(state())
    url = otlp_url(exporter)
    assert url.startswith("http://127.0.0.1:") and not url.startswith(exporter.url)
    reader = PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=url, compression=Compression.Gzip),
        export_interval_millis=3_600_000,
    )
    provider = MeterProvider(
        resource=Resource.create(
            {
                "service.instance.id": "embedder-0",
                "gpu.uuid": "GPU-00000002-aaaa-bbbb-cccc-000000000002",
                "gpubalance.class": "batch",
            }
        ),
        metric_readers=[reader],
    )
    meter = provider.get_meter("test")
    depth = meter.create_up_down_counter("gpubalance.queue.depth")
    delay = meter.create_histogram("gpubalance.batch.assembly_delay", unit="s")
    failures = meter.create_counter("gpubalance.memory.allocation_failures")
    depth.add(7)
    for wait in (0.1, 0.2, 0.3):
        delay.record(wait)
    failures.add(2)
    assert provider.force_flush(10_000)
    ids = {"worker": "embedder-0", "gpu": "2", "class": "batch", "source": "otlp"}
    m = exporter.wait_for(lambda m: m.has("gpubalance_queue_depth", **ids))
    assert m.value("gpubalance_queue_depth", **ids) == 7
    assert m.value("gpubalance_batch_assembly_delay_seconds_sum", **ids) == pytest.approx(0.6)
    assert m.value("gpubalance_batch_assembly_delay_seconds_count", **ids) == 3
    assert m.value("gpubalance_memory_allocation_failures_total", **ids) == 2
    assert m.value("gpubalance_serving_source_up", source="otlp") == 1
    provider.shutdown()
    # what is not OTLP is refused with a status and a message; the rest keeps working
    for data, content_type, code in (
        (b"hello", "text/plain", 415),
        (b"\x00garbage", "application/x-protobuf", 400),
        (b"[1, 2]", "application/json", 400),
    ):
        request = urllib.request.Request(url, data=data, headers={"Content-Type": content_type})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == code
        assert refused.value.read()  # the message
    # the scrape port is read-only: a push there is answered with where pushes go
    pushed = urllib.request.Request(
        exporter.url + "/v1/metrics",
        data=b"\n\x00",
        headers={"Content-Type": "application/x-protobuf"},
    )
    with pytest.raises(urllib.error.HTTPError) as moved:
        urllib.request.urlopen(pushed, timeout=10)
    assert moved.value.code == 404
    text = moved.value.read().decode()
    assert url in text and "exporter.serving.otlp.listen" in text
    # what the receiver took and refused, as counters by outcome: two pushes (the flush and the
    # provider's shutdown) of three points each, and the three refusals
    requests, points = (
        "gpubalance_serving_source_requests_total",
        "gpubalance_serving_source_points_total",
    )
    m = exporter.wait_for(lambda m: sum(v for _, v in m.find(requests, source="otlp")) == 5)
    assert m.value("gpubalance_queue_depth", **ids) == 7
    assert m.value(requests, source="otlp", outcome="accepted") == 2
    assert m.value(requests, source="otlp", outcome="malformed") == 2
    assert m.value(points, source="otlp", outcome="accepted") == 6
    assert m.value(points, source="otlp", outcome="rejected") == 0


def otlp_url(exporter: RunningExporter) -> str:
    """Where the exporter's OTLP receiver listens, from its log."""
    match = re.search(r"OTLP receiver at (\S+)", exporter.log())
    assert match, exporter.log()
    return match.group(1)


def test_otlp_listens_on_loopback_4318_by_default_and_instrument_pushes_there() -> None:
    assert ExporterConfig().serving.otlp.listen == "127.0.0.1:4318"
    assert DEFAULT_ENDPOINT == "http://127.0.0.1:4318/v1/metrics"


def test_instrument_pushes_the_batch_limit_it_is_given(start_exporter) -> None:
    exporter = start_exporter(state())
    with ServingMetrics(otlp_url(exporter), worker="llm-7", gpu_index=1, max_batch_size=24) as m:
        m.set_queue_depth(3)
        assert m.flush()
    ids = {"worker": "llm-7", "gpu": "1", "source": "otlp"}
    scrape = exporter.wait_for(lambda s: s.has("gpubalance_batch_size_limit", **ids))
    assert scrape.value("gpubalance_batch_size_limit", **ids) == 24
    assert scrape.value("gpubalance_queue_depth", **ids) == 3


def _certificate(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "otlp.crt", tmp_path / "otlp.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def test_beyond_loopback_pushes_need_tls_and_the_token(
    start_exporter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    # requests lets these override the session's CA file, which the SDK's certificate_file sets
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    cert, key = _certificate(tmp_path)
    token = tmp_path / "otlp.token"
    token.write_text("4a1f0c9e7d\n")
    path = tmp_path / "gpubalance.yaml"
    path.write_text(
        "exporter:\n  serving:\n    otlp:\n"
        f"      token_file: {token}\n      tls_cert_file: {cert}\n      tls_key_file: {key}\n"
    )
    exporter = start_exporter(state(), "--config", str(path), "--otlp-listen", "0.0.0.0:0")
    port = otlp_url(exporter).rsplit(":", 1)[1].split("/")[0]
    url = f"https://127.0.0.1:{port}/v1/metrics"

    def push(depth: int, bearer: str | None) -> None:
        """One push, answered before this returns (a 401 only logged by the SDK)."""
        headers = {"Authorization": f"Bearer {bearer}"} if bearer is not None else None
        exporter_ = OTLPMetricExporter(endpoint=url, certificate_file=str(cert), headers=headers)
        provider = MeterProvider(
            resource=Resource.create({"service.instance.id": "tls-0", "gpu.index": 1}),
            metric_readers=[PeriodicExportingMetricReader(exporter_, 3_600_000)],
        )
        provider.get_meter("test").create_up_down_counter("gpubalance.queue.depth").add(depth)
        assert provider.force_flush(10_000)
        provider.shutdown()

    push(5, "4a1f0c9e7d")
    ids = {"worker": "tls-0", "gpu": "1", "source": "otlp"}
    exporter.wait_for(lambda m: m.has("gpubalance_queue_depth", **ids))
    push(9, "4a1f0c9e7e")
    push(9, None)
    context = ssl.create_default_context(cafile=str(cert))
    for headers in ({}, {"Authorization": "Bearer 4a1f0c9e7e"}):
        request = urllib.request.Request(
            url, data=b"", headers={"Content-Type": "application/x-protobuf", **headers}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10, context=context)
        assert refused.value.code == 401
    assert exporter.metrics().value("gpubalance_queue_depth", **ids) == 5


@pytest.mark.parametrize(
    ("otlp", "listen", "says"),
    [
        ("{}", "0.0.0.0:4318", "exporter.serving.otlp.listen (--otlp-listen): 0.0.0.0:4318 is"),
        ("{token_file: TOKEN}", ":0", "beyond loopback"),  # a token over plain HTTP
        ("{tls_cert_file: TOKEN}", "127.0.0.1:0", "tls_cert_file and tls_key_file go together"),
        ("{token_file: MISSING}", "127.0.0.1:0", "exporter.serving.otlp.token_file: cannot read"),
    ],
    ids=["no-auth", "token-without-tls", "cert-without-key", "no-token-file"],
)
def test_an_unguarded_otlp_listener_is_a_config_error(
    tmp_path: Path, otlp: str, listen: str, says: str
) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    otlp = otlp.replace("TOKEN", str(token)).replace("MISSING", str(tmp_path / "missing"))
    path = tmp_path / "gpubalance.yaml"
    path.write_text(f"exporter:\n  serving:\n    otlp: {otlp}\n")
    result = subprocess.run(
        [
            *(sys.executable, "-m", "gpubalance", "exporter", "--config", str(path)),
            *("--listen", "127.0.0.1:0", "--otlp-listen", listen),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("gpubalance exporter: ") and says in line
