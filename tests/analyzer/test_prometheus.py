"""The Prometheus source on recorded answers of a real Prometheus: no network, no Prometheus.

The answers in ``fixtures/prometheus-fleet.json`` are what Prometheus said to the source's
queries over a small fleet written here (:func:`fleet_openmetrics`) and backfilled with
``promtool tsdb create-blocks-from openmetrics``: two hosts, a NaN reading, a failed scrape, a
counter reset, a GPU lost, a host that appears mid-range. The tests replay them from a local
HTTP server; ``test_the_recording_is_what_prometheus_answers`` asks a real Prometheus again when
one is installed (``GPUBALANCE_UPDATE_GOLDEN=1`` rewrites the recording after a query changed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import refusing_port

from gpubalance.analyzer.frames import GpuFrame
from gpubalance.analyzer.prometheus import (
    Matrix,
    PrometheusSource,
    parse_matrix,
    window_gauge_figures,
)
from gpubalance.analyzer.sources import (
    ExporterSource,
    LabRunSource,
    SourceError,
    open_source,
)
from gpubalance.lab.live.ports import start_prometheus

FIXTURE = Path(__file__).parent / "fixtures" / "prometheus-fleet.json"
UPDATE = os.environ.get("GPUBALANCE_UPDATE_GOLDEN") == "1"

WINDOW = 30.0
SCRAPE = 5.0
T0 = 1_749_999_990.0  # a multiple of the window: window k is (T0 + 30k, T0 + 30(k + 1)]
SAMPLES = 30  # every 5 s from T0 + 2: six per window, five windows
END = T0 + SAMPLES * SCRAPE
A, B = "host-a:9400", "host-b:9400"


def sample_time(j: int) -> float:
    return T0 + 2 + SCRAPE * j


# -- the fleet ----------------------------------------------------------------------------------


def fleet_openmetrics() -> str:
    """Host A from the start (two GPUs, serving, processes, PSI); host B from window 2 (one
    GPU, no serving, no PSI, no clocks). A's scrape 8 fails; its GPU 1 reads NaN at sample 14,
    throttles at 19, is lost in window 4; its worker on GPU 0 restarts at sample 21."""
    series: dict[str, list[str]] = {}

    def add(name: str, labels: Mapping[str, str], value: float, j: int) -> None:
        text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        shown = "NaN" if value != value else repr(float(value))
        series.setdefault(name, []).append(f"{name}{{{text}}} {shown} {sample_time(j)}")

    for j in range(SAMPLES):
        t = sample_time(j) - T0
        window = j // 6
        for host in (A, B):
            if host == B and window < 2:
                continue
            job = {"job": "gpubalance", "instance": host}
            up = not (host == A and j == 8)
            add("up", job, float(up), j)
            if not up:
                continue
            add("gpubalance_exporter_window_seconds", job, 5.0 if host == A else 30.0, j)
            for mode, per_second in (
                ("user", 0.5),
                ("nice", 0.0),
                ("system", 0.0),
                ("idle", 0.4),
                ("iowait", 0.1),
                ("irq", 0.0),
                ("softirq", 0.0),
                ("steal", 0.0),
            ):
                for cpu in ("0", "1"):
                    add(
                        "gpubalance_host_cpu_seconds_total",
                        {**job, "cpu": cpu, "mode": mode},
                        1000 + per_second * t,
                        j,
                    )
                # the exporter's sum over the two CPUs, which the source reads
                add(
                    "gpubalance_host_cpu_mode_seconds_total",
                    {**job, "mode": mode},
                    2 * (1000 + per_second * t),
                    j,
                )
            gpus = [("0", "GPU-a0", "RTX 4090"), ("1", "GPU-a1", "RTX 3090")]
            if host == B:
                gpus = [("0", "GPU-b0", "RTX 4090")]
            for index, uuid, card in gpus:
                ids = {**job, "gpu": index, "uuid": uuid}
                add("gpubalance_gpu_info", {**ids, "name": card, "driver_version": "570"}, 1, j)
                lost = uuid == "GPU-a1" and window == 4
                add("gpubalance_gpu_lost", ids, float(lost), j)
                if lost:
                    continue
                if uuid == "GPU-a0":
                    utilization = [0.8, 0.9, 1.0, 0.9, 0.8, 1.0][j % 6]
                elif uuid == "GPU-a1":
                    utilization = float("nan") if j == 14 else 0.2
                else:
                    utilization = 0.05 * (j % 6)  # a ramp: the last value differs from the mean
                add("gpubalance_gpu_utilization_ratio", ids, utilization, j)
                thermal = uuid == "GPU-a1" and j == 19
                add("gpubalance_gpu_throttled_ratio", ids, float(thermal), j)
                for reason, active in (
                    ("gpu_idle", uuid == "GPU-a1"),
                    ("sw_power_cap", False),
                    ("sw_thermal_slowdown", thermal),
                ):
                    add("gpubalance_gpu_throttle_reason", {**ids, "reason": reason}, active, j)
                used = 8e9 + 1e6 * t if uuid == "GPU-a0" else 4e9
                add("gpubalance_gpu_memory_used_bytes", ids, used, j)
                add("gpubalance_gpu_memory_total_bytes", ids, 24e9, j)
                add("gpubalance_gpu_temperature_celsius", ids, 60.0 if index == "0" else 50.0, j)
                if host == A:  # B's driver has no clocks or power readings
                    sm = {**ids, "clock": "sm"}
                    add("gpubalance_gpu_clock_hertz", sm, 2.0e9, j)
                    add("gpubalance_gpu_max_clock_hertz", sm, 2.5e9, j)
                    add("gpubalance_gpu_power_watts", ids, 300.0, j)
                    add("gpubalance_gpu_power_limit_watts", ids, 450.0, j)
            if host == B:
                continue
            for pressure, per_second in (("cpu", 0.05), ("io", 0.2)):
                for kind in ("some", "full"):
                    add(
                        "gpubalance_host_pressure_waiting_seconds_total",
                        {**job, "resource": pressure, "kind": kind},
                        100 + per_second * t,
                        j,
                    )
            # processes: 100 feeds GPU 0 at one core, 101 feeds GPU 1 (its I/O unreadable)
            on_gpu0 = {**job, "gpu": "0", "uuid": "GPU-a0", "pid": "100"}
            add("gpubalance_gpu_process_memory_used_bytes", on_gpu0, 4e9, j)
            proc = {**job, "pid": "100", "process": "python3"}
            add("gpubalance_process_cpu_seconds_total", proc, 500 + 1.0 * t, j)
            add("gpubalance_process_read_bytes_total", proc, 1e9 + 1e6 * t, j)
            if window < 4:
                on_gpu1 = {**job, "gpu": "1", "uuid": "GPU-a1", "pid": "101"}
                add("gpubalance_gpu_process_memory_used_bytes", on_gpu1, 4e9, j)
                add(
                    "gpubalance_process_cpu_seconds_total",
                    {**job, "pid": "101", "process": "python3"},
                    20 + 0.25 * t,
                    j,
                )
            # serving: GPU 0's queue by UUID, 10 requests/s, restarting at sample 21 (and an
            # idle class queue beside it); GPU 1's queue by index alone (a source without
            # UUIDs), 2 requests/s
            done = 1000 + 10 * t if j < 21 else 10 * (t - 107) + 50
            w0 = {"gpu": "0", "uuid": "GPU-a0", "worker": "w0", "class": "interactive"}
            queues = [({**w0, "source": "vllm"}, 4.0 + j % 3, 8.0, done, 0.5 + 0.05 * (j % 3))]
            if window < 4:
                w1 = {"gpu": "1", "uuid": "", "worker": "w1", "class": "batch"}
                queues.append(({**w1, "source": "triton"}, 0.0, 1.0, 200 + 2 * t, 0.1))
            for labels, depth, running, requests, kv in queues:
                queue = {**job, **labels, "queue": "llama"}
                add("gpubalance_queue_depth", queue, depth, j)
                add("gpubalance_batch_running_requests", queue, running, j)
                add("gpubalance_kv_cache_usage_ratio", queue, kv, j)
                add("gpubalance_request_duration_seconds_count", queue, requests, j)
                add("gpubalance_request_duration_seconds_sum", queue, 0.5 * requests, j)
                add("gpubalance_batch_assembly_delay_seconds_count", queue, requests, j)
                add("gpubalance_batch_assembly_delay_seconds_sum", queue, 0.02 * requests, j)
                add("gpubalance_batch_size_count", queue, requests / 4, j)
                add("gpubalance_batch_size_sum", queue, requests, j)
                failures = 3.0 if labels["worker"] == "w0" and j >= 25 else 0.0
                add("gpubalance_memory_allocation_failures_total", queue, failures, j)
                if labels["source"] == "vllm":  # Triton counts no tokens
                    add("gpubalance_prompt_tokens_total", queue, 600 * requests, j)
                    add("gpubalance_generation_tokens_total", queue, 50 * requests, j)
            # w0 lists a batch class queue too, which no request comes to: not a class served
            idle = {**job, **w0, "source": "vllm", "queue": "llama", "class": "batch"}
            add("gpubalance_queue_depth", idle, 0.0, j)
            add("gpubalance_request_duration_seconds_count", idle, 0.0, j)
            add("gpubalance_request_duration_seconds_sum", idle, 0.0, j)
    lines = [line for name in sorted(series) for line in sorted(series[name], key=_series_order)]
    return "\n".join([*lines, "# EOF", ""])


def _series_order(line: str) -> tuple[str, float]:
    labels, _, stamp = line.rpartition(" ")
    return labels.rpartition(" ")[0], float(stamp)


# the calls whose answers are recorded: name -> (source options, frames arguments)
CALLS: dict[str, tuple[dict[str, Any], tuple[Any, ...]]] = {
    "fleet": ({}, (T0, END, WINDOW)),
    "host-b": ({"scrape_interval_seconds": SCRAPE}, (T0, END, WINDOW, [B])),
    "bad-selector": ({"selector": 'job=~"("'}, (T0, END, WINDOW)),
    # 15,000 windows of 10 ms: more points than Prometheus gives in one answer
    "pieces": ({}, (T0, END, 0.01, [B])),
    "unaligned": ({}, (T0 + 31, END - 1, WINDOW, [B])),
}


# -- recording and replaying ----------------------------------------------------------------------


def request_key(method: str, path: str, form: Mapping[str, str]) -> str:
    # the query timeout follows the client's, and Prometheus ignores Thanos' partial_response:
    # the answer depends on neither
    ignored = ("timeout", "partial_response")
    return json.dumps([method, path, sorted((k, v) for k, v in form.items() if k not in ignored)])


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    disable_nagle_algorithm = True  # headers and body leave at once, not 40 ms apart

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the tests say what failed
        pass

    def _answer(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        form = dict(urllib.parse.parse_qsl(self.rfile.read(length).decode() or url.query))
        self.server.seen.append((url.path, form, self.headers))
        status, content_type, body = self.server.answer(method, url.path, form)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # the source's parallel queries; the default 5 drops SYNs

    def __init__(self, answer: Callable[[str, str, dict[str, str]], tuple[int, str, bytes]]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer = answer
        self.seen: list[tuple[str, dict[str, str], Message]] = []  # path, form, headers

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def serve(answer: Callable[[str, str, dict[str, str]], tuple[int, str, bytes]]) -> _Server:
    server = _Server(answer)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server


Recording = dict[str, dict[str, Any]]  # request key -> {"status", "type", "body"}


def replay(recording: Recording) -> _Server:
    def answer(method: str, path: str, form: dict[str, str]) -> tuple[int, str, bytes]:
        hit = recording.get(request_key(method, path, form))
        if hit is None:
            error = {
                "status": "error",
                "errorType": "not_recorded",
                "error": f"no recorded answer to {method} {path} {form}; rerun with "
                "GPUBALANCE_UPDATE_GOLDEN=1 where Prometheus is installed",
            }
            return 404, "application/json", json.dumps(error).encode()
        return hit["status"], hit["type"], hit["body"].encode()

    return serve(answer)


@pytest.fixture(scope="module")
def recording() -> Recording:
    return json.loads(FIXTURE.read_text())["answers"]


@pytest.fixture
def replayed(recording: Recording) -> Iterator[str]:
    server = replay(recording)
    yield server.url
    server.shutdown()


def record(tmp_path: Path) -> dict[str, Any]:
    """Backfill the fleet, start Prometheus on it, and record its answers to :data:`CALLS`."""
    (tmp_path / "fleet.om").write_text(fleet_openmetrics())
    subprocess.run(
        ["promtool", "tsdb", "create-blocks-from", "openmetrics", "fleet.om", "tsdb"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
    )
    (tmp_path / "prometheus.yml").write_text("scrape_configs: []\n")
    prometheus = start_prometheus(
        tmp_path / "prometheus.yml",
        tmp_path / "tsdb",
        "--storage.tsdb.retention.time=100y",  # the fleet's time is long past
    )
    upstream = prometheus.url
    answers: Recording = {}

    def forward(method: str, path: str, form: dict[str, str]) -> tuple[int, str, bytes]:
        data = urllib.parse.urlencode(form).encode() if method == "POST" else None
        try:
            with urllib.request.urlopen(upstream + path, data=data, timeout=30) as response:
                status, kind = response.status, response.headers["Content-Type"]
                body = response.read()
        except urllib.error.HTTPError as error:
            status, kind, body = error.code, error.headers["Content-Type"], error.read()
        answers[request_key(method, path, form)] = {
            "status": status,
            "type": kind,
            "body": body.decode(),
        }
        return status, kind, body

    proxy = serve(forward)
    try:
        version = PrometheusSource(proxy.url).build_info()["version"]
        for options, arguments in CALLS.values():
            with contextlib.suppress(SourceError):  # an error is recorded like any answer
                PrometheusSource(proxy.url, **options).frames(*arguments)
    finally:
        proxy.shutdown()
        prometheus.stop()
    return {"prometheus": version, "answers": answers}


@pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="apt-get install prometheus",
)
def test_the_recording_is_what_prometheus_answers(tmp_path: Path) -> None:
    fresh = record(tmp_path)
    if UPDATE:
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(json.dumps(fresh, indent=1, sort_keys=True) + "\n")
    stored = json.loads(FIXTURE.read_text())
    if fresh["prometheus"] != stored["prometheus"]:
        # another version answers some queries otherwise (Prometheus 3's ranges leave out a
        # sample at their start): the replayed tests hold for the recorded one
        pytest.skip(f"recorded with Prometheus {stored['prometheus']}, not {fresh['prometheus']}")
    assert set(fresh["answers"]) == set(stored["answers"]), "rerun with GPUBALANCE_UPDATE_GOLDEN=1"
    for key, answer in fresh["answers"].items():
        was = stored["answers"][key]
        assert (answer["status"], json.loads(answer["body"])) == (
            was["status"],
            json.loads(was["body"]),
        ), key


# -- the frames ---------------------------------------------------------------------------------


def by_key(frames: list[GpuFrame]) -> dict[tuple[str, str, int], GpuFrame]:
    return {(f.host, f.uuid, round((f.t_start - T0) / WINDOW)): f for f in frames}


@pytest.fixture
def fleet(replayed: str) -> dict[tuple[str, str, int], GpuFrame]:
    source = PrometheusSource(replayed)
    frames = source.frames(T0, END, WINDOW)
    assert source.last_warnings == ()
    assert frames == sorted(frames, key=lambda f: (f.t_start, f.host, f.gpu))
    return by_key(frames)


def test_one_frame_per_gpu_per_window_it_was_reported_in(
    fleet: dict[tuple[str, str, int], GpuFrame],
) -> None:
    assert sorted(fleet) == sorted(
        [(A, "GPU-a0", k) for k in range(5)]
        + [(A, "GPU-a1", k) for k in range(5)]
        + [(B, "GPU-b0", k) for k in (2, 3, 4)]  # B appears in window 2
    )
    first = fleet[(A, "GPU-a0", 0)]
    assert (first.t_start, first.t_end, first.gpu, first.card) == (T0, T0 + 30, 0, "RTX 4090")
    assert (first.sample_count, first.expected_sample_count) == (6, 6)
    # the failed scrape of window 1 costs its sample; up says six were attempted
    assert fleet[(A, "GPU-a0", 1)].sample_count == 5
    assert fleet[(A, "GPU-a0", 1)].coverage_ratio == pytest.approx(5 / 6)
    appeared = fleet[(B, "GPU-b0", 2)]
    assert (appeared.sample_count, appeared.expected_sample_count) == (6, 6)


def test_gauges_and_counters_of_a_gpu(fleet: dict[tuple[str, str, int], GpuFrame]) -> None:
    f = fleet[(A, "GPU-a0", 0)]
    assert f.utilization_mean_ratio == pytest.approx(0.9)
    # the exporter's window (5 s) is a sixth of the analysis window: its percentile says something
    assert f.utilization_p95_ratio == pytest.approx(1.0)
    assert f.memory_used_bytes == 8e9 + 27e6  # the last reading, at T0 + 27
    assert f.memory_total_bytes == 24e9
    assert f.memory_used_slope_bytes_per_second == pytest.approx(1e6)
    assert f.sm_clock_ratio == pytest.approx(0.8)
    assert f.power_ratio == pytest.approx(300 / 450)
    assert f.temperature_celsius == pytest.approx(60)
    assert (f.throttled_ratio, f.throttle_reasons, f.lost) == (0.0, frozenset(), False)
    assert (f.serving_queues, f.queue_names, f.service_classes) == (1, ("llama",), ("interactive",))
    assert f.queue_depth_mean == pytest.approx(5.0)
    assert f.queue_depth_max == 6.0
    assert f.running_mean == pytest.approx(8.0)
    assert f.kv_cache_usage_ratio == pytest.approx(0.55)
    assert f.completions_per_second == pytest.approx(10.0)
    assert f.request_duration_seconds == pytest.approx(0.5)
    assert f.batch_delay_seconds == pytest.approx(0.02)
    assert f.batch_size_mean == pytest.approx(4.0)
    assert f.allocation_failures == 0.0
    assert f.prompt_tokens_per_second == pytest.approx(6000.0)
    assert f.generation_tokens_per_second == pytest.approx(500.0)
    assert (f.feeder_processes, f.feeder_cpu_cores_max) == (1, pytest.approx(1.0))
    assert f.feeder_read_bytes_per_second == pytest.approx(1e6)
    assert f.host_cpu_busy_ratio == pytest.approx(0.5)
    assert f.host_iowait_ratio == pytest.approx(0.1)
    assert f.host_cpu_pressure_ratio == pytest.approx(0.05)
    assert f.host_io_pressure_ratio == pytest.approx(0.2)


def test_a_queue_without_uuid_lands_on_its_gpu_by_index(
    fleet: dict[tuple[str, str, int], GpuFrame],
) -> None:
    f = fleet[(A, "GPU-a1", 0)]
    assert (f.serving_queues, f.service_classes, f.queue_depth_mean) == (1, ("batch",), 0.0)
    assert f.kv_cache_usage_ratio == pytest.approx(0.1)  # its own queue's, not GPU 0's
    assert f.completions_per_second == pytest.approx(2.0)
    assert f.prompt_tokens_per_second is None  # its server counts no tokens
    assert f.feeder_cpu_cores_max == pytest.approx(0.25)
    assert f.feeder_read_bytes_per_second is None  # its I/O counters were unreadable
    # GPU 0's queue is not counted on GPU 1 although both are "llama"
    assert fleet[(A, "GPU-a0", 0)].completions_per_second == pytest.approx(10.0)


def test_a_nan_reading_is_unknown_not_zero(fleet: dict[tuple[str, str, int], GpuFrame]) -> None:
    nan_window = fleet[(A, "GPU-a1", 2)]
    assert nan_window.utilization_mean_ratio is None
    assert nan_window.utilization_p95_ratio is None
    assert nan_window.memory_used_bytes == 4e9  # the other readings of the window stand
    assert fleet[(A, "GPU-a1", 1)].utilization_mean_ratio == pytest.approx(0.2)


def test_a_counter_reset_counts_from_zero(fleet: dict[tuple[str, str, int], GpuFrame]) -> None:
    restarted = fleet[(A, "GPU-a0", 3)]  # the worker restarts at sample 21, mid-window
    assert restarted.completions_per_second == pytest.approx(10.0)
    assert restarted.request_duration_seconds == pytest.approx(0.5)
    # three allocation failures in window 4; increase() extrapolates to the window's edges
    failures = fleet[(A, "GPU-a0", 4)].allocation_failures
    assert failures is not None and 3.0 <= failures <= 3.0 * 30 / 25


def test_throttling_and_a_lost_gpu(fleet: dict[tuple[str, str, int], GpuFrame]) -> None:
    throttled = fleet[(A, "GPU-a1", 3)]
    # gpu_idle is no slowdown; the thermal one was active at one scrape of six
    assert throttled.throttle_reasons == frozenset({"sw_thermal_slowdown"})
    assert throttled.throttled_ratio == pytest.approx(1 / 6)
    lost = fleet[(A, "GPU-a1", 4)]
    assert (lost.lost, lost.sample_count, lost.card) == (True, 0, "RTX 3090")
    assert (lost.utilization_mean_ratio, lost.memory_used_bytes) == (None, None)
    assert (lost.serving_queues, lost.queue_depth_mean, lost.feeder_processes) == (0, None, 0)


def test_what_a_host_does_not_report_stays_unknown(
    fleet: dict[tuple[str, str, int], GpuFrame],
) -> None:
    b = fleet[(B, "GPU-b0", 3)]
    # B's exporter averages over 30 s, the whole window: its last value is the window's mean
    assert b.utilization_mean_ratio == pytest.approx(0.25)
    assert b.utilization_p95_ratio is None  # a percentile of one 30 s mean says nothing
    assert (b.sm_clock_ratio, b.power_ratio) == (None, None)
    assert (b.host_cpu_pressure_ratio, b.host_io_pressure_ratio) == (None, None)
    assert (b.serving_queues, b.queue_depth_mean, b.completions_per_second) == (0, None, None)
    assert (b.feeder_processes, b.feeder_cpu_cores_max) == (0, None)
    assert b.host_cpu_busy_ratio == pytest.approx(0.5)


def test_host_cpu_comes_from_the_exporters_sum_over_cpus(recording: Recording) -> None:
    # a 32-CPU host has 256 per-CPU series to the sum's 8: most of what a fleet's queries cost
    # Prometheus when it summed them itself
    server = replay(recording)
    frames = PrometheusSource(server.url).frames(T0, END, WINDOW)
    server.shutdown()
    assert [f.host_cpu_busy_ratio for f in frames] == pytest.approx([0.5] * len(frames))
    assert [f.host_iowait_ratio for f in frames] == pytest.approx([0.1] * len(frames))
    selected = [form["query"] for _, form, _ in server.seen]
    assert any("gpubalance_host_cpu_mode_seconds_total" in query for query in selected)
    assert not [query for query in selected if "gpubalance_host_cpu_seconds_total" in query]


def test_a_scrape_late_into_the_next_window_leaves_the_others_whole(
    recording: Recording, fleet: dict[tuple[str, str, int], GpuFrame]
) -> None:
    """A busy Prometheus starts a scrape late now and then, and one window holds a scrape more
    than its interval gives: the windows expected to hold are the host's usual count, so the
    others stay whole (it was the most any window held, and every other window read short)."""
    jittered = dict(recording)
    [key] = [k for k in recording if '"max by (instance) (count_over_time(up[30s]))"' in k]
    body = json.loads(recording[key]["body"])
    for series in body["data"]["result"]:
        if series["metric"]["instance"] == A:
            series["values"][2][1] = "7"  # window 2 caught a late scrape of window 3
    jittered[key] = {**recording[key], "body": json.dumps(body)}
    server = replay(jittered)
    try:
        frames = by_key(PrometheusSource(server.url).frames(T0, END, WINDOW))
    finally:
        server.shutdown()
    for key, frame in fleet.items():
        assert frame.expected_sample_count == 6
        assert (frames[key].sample_count, frames[key].expected_sample_count) == (
            frame.sample_count,
            6,
        ), key


def test_hosts_narrow_every_query(replayed: str) -> None:
    frames = PrometheusSource(replayed, scrape_interval_seconds=SCRAPE).frames(
        T0, END, WINDOW, hosts=[B]
    )
    assert [(f.host, f.t_start) for f in frames] == [(B, T0 + 30 * k) for k in (2, 3, 4)]
    assert {f.expected_sample_count for f in frames} == {6}
    assert PrometheusSource(replayed).frames(T0, END, WINDOW, hosts=[]) == []


def test_only_the_window_gauge_figures_some_gpu_takes_are_asked(
    recording: Recording, fleet: dict[tuple[str, str, int], GpuFrame]
) -> None:
    # A's exporter window (5 s) is shorter than the analysis window: the gauges' means and
    # the utilization percentile; B's (30 s) covers it: their last values. Narrowed to B,
    # the means and the percentile are not asked and B's figures are those of the fleet's
    server = replay(recording)
    frames = PrometheusSource(server.url, scrape_interval_seconds=SCRAPE).frames(
        T0, END, WINDOW, hosts=[B]
    )
    server.shutdown()
    asked = [form["query"] for _, form, _ in server.seen]
    assert len(asked) == 44 - 3
    utilization = "gpubalance_gpu_utilization_ratio"
    assert not [q for q in asked if f"avg_over_time({utilization}" in q]
    assert not [q for q in asked if "quantile_over_time" in q]
    assert [q for q in asked if f"last_over_time({utilization}" in q]
    for frame in frames:
        whole = fleet[(B, frame.uuid, round((frame.t_start - T0) / WINDOW))]
        assert frame.utilization_mean_ratio == whole.utilization_mean_ratio is not None
        assert frame.throttled_ratio == whole.throttled_ratio
        assert frame.utilization_p95_ratio is None


def test_which_window_gauge_figures_follows_each_hosts_exporter_window() -> None:
    def matrix(rows: list[tuple[dict[str, str], list[float]]]) -> Matrix:
        return Matrix(tuple(labels for labels, _ in rows), np.array([v for _, v in rows]))

    nan = math.nan
    info = matrix([({"instance": "a", "gpu": "0"}, [1, 1]), ({"instance": "b"}, [nan, 1])])

    def kinds(a: list[float], b: list[float] | None = None) -> set[str]:
        windows = [({"instance": "a"}, a)] + ([({"instance": "b"}, b)] if b else [])
        return window_gauge_figures(info, matrix(windows), "instance", 30.0)

    assert kinds([30, 60], [nan, 45]) == {"last"}
    assert kinds([30, 60], [7.5, 7.5]) == {"last", "mean", "p95"}
    assert kinds([10, 10], [30, 30]) == {"last", "mean"}
    # b reports no GPU in the first window: its exporter window there asks nothing
    assert kinds([30, 30], [5, 30]) == {"last"}
    # an exporter without the gauge, or a step without it: the mean, as the frames take it
    assert kinds([30, nan], [30, 30]) == {"last", "mean"}
    assert kinds([30, 30]) == {"last", "mean"}
    assert window_gauge_figures(matrix([]), matrix([]), "instance", 30.0) == set()


def test_a_long_range_comes_in_pieces(replayed: str) -> None:
    # 15,000 windows of 10 ms: two queries per figure; each of B's samples ends one window
    frames = PrometheusSource(replayed).frames(T0, END, 0.01, hosts=[B])
    ends = {round(f.t_end, 2) for f in frames}
    samples = {sample_time(j) for j in range(12, SAMPLES)}  # T0 + 62 .. T0 + 147: both pieces
    assert samples <= ends
    # Prometheus 2's closed ranges also give a sample to the window that starts at it
    assert ends <= samples | {round(t + 0.01, 2) for t in samples}
    assert all(f.sample_count == 1 for f in frames)


def test_windows_align_to_multiples_of_the_window(replayed: str) -> None:
    # an unaligned range gives the whole windows inside it, on the same grid
    frames = PrometheusSource(replayed).frames(T0 + 31, END - 1, WINDOW, hosts=[B])
    assert sorted({f.t_start for f in frames}) == [T0 + 60, T0 + 90]
    assert PrometheusSource(replayed).frames(T0 + 1, T0 + 29, WINDOW) == []


# -- what goes wrong ------------------------------------------------------------------------------


def test_credentials_and_options_go_with_every_query(recording: Recording) -> None:
    server = replay(recording)
    source = PrometheusSource(
        server.url,
        bearer_token="s3cret",
        headers={"X-Scope-OrgID": "fleet"},  # Mimir's tenant
        partial_response=False,
        timeout=12.5,
    )
    assert len(source.frames(T0, END, WINDOW)) == 13
    server.shutdown()
    # one query per figure (per slowdown reason), for every host at once; the exporters' windows
    # (5 s and 30 s) need every figure of the window gauges
    assert len(server.seen) == 44
    for path, form, headers in server.seen:
        assert path == "/api/v1/query_range"
        assert (headers["Authorization"], headers["X-Scope-OrgID"]) == ("Bearer s3cret", "fleet")
        assert (form["partial_response"], form["timeout"]) == ("false", "12500ms")


def test_prometheus_own_error_message_is_shown(replayed: str) -> None:
    with pytest.raises(SourceError, match=r"HTTP 400: bad_data: .*error parsing regexp"):
        PrometheusSource(replayed, selector='job=~"("').frames(T0, END, WINDOW)


def test_a_down_prometheus_says_so() -> None:
    with (
        refusing_port() as port,
        pytest.raises(SourceError, match=r"cannot reach Prometheus: .*refused"),
    ):
        PrometheusSource(f"http://127.0.0.1:{port}").frames(T0, END, WINDOW)


def edited(
    recording: Recording, change: Callable[[dict[str, Any]], tuple[int, str, bytes]]
) -> _Server:
    """A replay in which every range query's answer goes through ``change``."""

    def answer(method: str, path: str, form: dict[str, str]) -> tuple[int, str, bytes]:
        hit = recording[request_key(method, path, form)]
        return change({**hit, "body": json.loads(hit["body"]), "query": form.get("query", "")})

    return serve(answer)


def test_warnings_are_kept_and_logged(
    recording: Recording, caplog: pytest.LogCaptureFixture
) -> None:
    warning = "partial response: store 10.0.0.7:10901 unavailable"

    def partial(hit: dict[str, Any]) -> tuple[int, str, bytes]:
        if "avg_over_time" in hit["query"]:
            hit["body"]["warnings"] = [warning]
        return hit["status"], hit["type"], json.dumps(hit["body"]).encode()

    server = edited(recording, partial)
    source = PrometheusSource(server.url)
    with caplog.at_level(logging.WARNING):
        frames = source.frames(T0, END, WINDOW)
    server.shutdown()
    assert len(frames) == 13  # the partial answer is still used
    assert source.last_warnings == (warning,)  # once, though several answers carried it
    assert warning in caplog.text


def test_an_answer_that_is_no_matrix_is_refused(recording: Recording) -> None:
    def vector(hit: dict[str, Any]) -> tuple[int, str, bytes]:
        hit["body"]["data"]["resultType"] = "vector"
        return hit["status"], hit["type"], json.dumps(hit["body"]).encode()

    server = edited(recording, vector)
    with pytest.raises(SourceError, match=r"expected a matrix.*'vector'"):
        PrometheusSource(server.url).frames(T0, END, WINDOW)
    server.shutdown()


def test_a_proxy_error_page_is_shown(recording: Recording) -> None:
    def bad_gateway(hit: dict[str, Any]) -> tuple[int, str, bytes]:
        return 502, "text/html", b"<html><body>502 Bad Gateway</body></html>"

    server = edited(recording, bad_gateway)
    with pytest.raises(SourceError, match="HTTP 502: <html><body>502 Bad Gateway"):
        PrometheusSource(server.url).frames(T0, END, WINDOW)
    server.shutdown()


def test_parse_matrix_puts_points_on_the_grid() -> None:
    body = {
        "status": "success",
        "data": {
            "resultType": "matrix",
            "result": [
                {"metric": {"gpu": "0"}, "values": [[30, "1.5"], [90, "NaN"], [120, "+Inf"]]},
                {"metric": {"gpu": "1"}, "values": [[60, "2"], [999, "7"]]},
            ],
        },
    }
    matrix = parse_matrix(body, 30.0, 30.0, 4)
    assert matrix.labels == ({"gpu": "0"}, {"gpu": "1"})
    assert np.array_equal(
        matrix.values,
        np.array([[1.5, np.nan, np.nan, np.nan], [np.nan, 2.0, np.nan, np.nan]]),
        equal_nan=True,
    )
    with pytest.raises(SourceError, match="not a Prometheus matrix"):
        parse_matrix({"data": {"resultType": "matrix", "result": [{"values": []}]}}, 0, 1, 1)


# -- open_source ----------------------------------------------------------------------------------


def test_open_source_finds_prometheus(replayed: str) -> None:
    source = open_source(replayed)
    assert isinstance(source, PrometheusSource)
    assert source.probe() == "Prometheus API 2.42.0+ds"  # the one that answered the recording
    assert len(source.frames(T0, END, WINDOW)) == 13


def test_open_source_finds_an_api_without_buildinfo() -> None:
    def only_queries(method: str, path: str, form: dict[str, str]) -> tuple[int, str, bytes]:
        if (method, path, form) == ("POST", "/api/v1/query", {"query": "1"}):
            answer = {"status": "success", "data": {"resultType": "scalar", "result": [T0, "1"]}}
            return 200, "application/json", json.dumps(answer).encode()
        return 404, "text/plain", b"404 page not found"

    server = serve(only_queries)
    source = open_source(server.url)
    assert isinstance(source, PrometheusSource)
    assert source.probe() == "Prometheus-compatible API"
    server.shutdown()


def test_open_source_finds_a_lab_run(tmp_path: Path) -> None:
    (tmp_path / "frames.csv").write_text(
        "t,gpu,uuid,card,lost,utilization,memory_used_bytes,memory_total_bytes,"
        "throttle_reasons\n1,0,GPU-x,RTX 4090,0,0.5,1,2,\n"
    )
    source = open_source(str(tmp_path))
    assert source == LabRunSource(tmp_path)
    assert [f.utilization_mean_ratio for f in source.frames(None, None, 30.0)] == [0.5]


def test_open_source_says_what_each_probe_found(tmp_path: Path) -> None:
    def nothing(method: str, path: str, form: dict[str, str]) -> tuple[int, str, bytes]:
        return 404, "text/plain", b"404 page not found"

    server = serve(nothing)
    with pytest.raises(SourceError) as caught:
        open_source(server.url)
    server.shutdown()
    message = str(caught.value)
    assert "neither a Prometheus API nor a gpubalance exporter" in message
    assert "buildinfo: HTTP 404: 404 page not found" in message
    assert "snapshot?history=0: HTTP 404" in message
    with pytest.raises(SourceError, match="not a lab run directory"):
        open_source(str(tmp_path))
    with pytest.raises(SourceError, match="neither a URL"):
        open_source(str(tmp_path / "missing"))
    assert ExporterSource("http://x").description == "exporter at http://x"
