"""Soak: the exporter process under steady churn for --minutes, its RSS, open fds and threads
read as it runs, to show that none of them grows once its history is full.

The real exporter (``python -m gpubalance exporter``) runs on the fake NVML driver with 8 GPUs
and a fake procfs tree, and this script keeps it busy the whole time, on 127.0.0.1 only:

- GPU processes: every 0.1 s one exits and a new one appears (a new PID, with its /proc
  entry), 10 a second of each, 6 per GPU at any time;
- a vLLM endpoint (its exposition rendered by prometheus_client, as vLLM renders it) that flaps
  between up, slow (it answers after the exporter's scrape timeout) and down (connections
  refused and open ones dropped) every few seconds;
- OTLP/HTTP pushes, protobuf and every other one gzip, 50 a second from 8 workers;
- 4 scrapers on /metrics (all three naming profiles) and /api/v1/snapshot (with history), two
  on keep-alive connections and two opening a connection per request.

The exporter's RSS, open fds and threads are read every --sample-every seconds (psutil). After
--warmup minutes (by then the history of --trend-window seconds has filled) each is fitted with
a Theil-Sen line, the median of the pairwise slopes, which one reading taken during a GC pause
or a burst of connections does not tilt. The fitted growth over the rest of the run must stay
under --max-rss-growth-mib, and under one fd and one thread; the exit status is 1 when it does
not, or when the exporter failed a request or exited. RSS that grew past the bound fails only
where it still grows at the end: a leak keeps its pace to the end, while a heap still filling
after a warm-up too short for the machine's load (the allocator keeps the buffers of requests
in flight, more of them on a busy machine) levels off; so the RSS line of the last half of the
readings after the warm-up, over the same span, must pass the bound too. Results: the "Soak"
section of bench/RESULTS.md and bench/soak.png; --json writes every reading.

    python bench/soak.py [--minutes 30] [--warmup 5] [--sample-every 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import itertools
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.exposition import generate_latest

from gpubalance.lab.fakenvml import build_library, write_state
from gpubalance.lab.live.ports import free_port
from gpubalance.lab.live.procfs import write_procfs
from gpubalance.telemetry import (
    CpuTimes,
    DiskCounters,
    HostSample,
    NetworkCounters,
    PressureStall,
    ProcessHostStats,
)

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))
from results import progress, write_section  # noqa: E402

GPUS = 8
PROCESSES_PER_GPU = 6
CHURN_PER_SECOND = 10  # processes that exit, and as many that appear, each second
OTLP_PUSHES_PER_SECOND = 50
OTLP_WORKERS = 8
SCRAPERS = 4
SCRAPE_PAUSE_SECONDS = 0.5  # per scraper, between requests: 8 requests a second in all
SNAPSHOT_HISTORY = 30  # samples, or the whole history where it is shorter
SERVING_TIMEOUT_SECONDS = 0.5  # the exporter's serving.timeout, set in its configuration
# The endpoint's cycle, (mode, seconds): "slow" answers after three scrape timeouts.
FLAP_PHASES = (("up", 4.0), ("slow", 3.0), ("up", 4.0), ("down", 3.0))
PROCESS_NAMES = ("python3", "vllm-engine", "tritonserver", "sglang-worker")
MIB = 1024 * 1024
LISTENING = re.compile(r"listening on (http://[\d.]+:(\d+))")
SOURCE_UP = re.compile(r'^gpubalance_serving_source_up\{[^}]*source="vllm"[^}]*\} (\S+)$', re.M)
ANCHOR = (
    "dcgm-exporter's leak reports are the anchor: "
    "[#536](https://github.com/NVIDIA/dcgm-exporter/issues/536) (4.2.3-4.1.3 pods on H100 nodes "
    "grew to about 50 GB) and [#702](https://github.com/NVIDIA/dcgm-exporter/issues/702) "
    "(4.4.2-4.7.1: anon-rss climbs from about 100 MB to its 512 MiB limit in 24-48 h, then an "
    "OOM kill, on every node)."
)


# -- where OTLP goes -----------------------------------------------------------------------


def otlp_has_own_listener() -> bool:
    """Whether this exporter takes OTLP on a listener of its own (``--otlp-listen``), not on
    the scrape port: asked of the exporter itself, so the soak runs on either."""
    help_text = subprocess.run(
        [sys.executable, "-m", "gpubalance", "exporter", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return "--otlp-listen" in help_text


def otlp_push_url(scrape_url: str, otlp_listen: str | None) -> str:
    """The one place the push URL is made: the OTLP listener's, or else the scrape port's."""
    return (f"http://{otlp_listen}" if otlp_listen else scrape_url) + "/v1/metrics"


def held_port() -> socket.socket:
    """A port on 127.0.0.1 kept for the whole soak by a bound socket that never listens.

    The flapping endpoint closes its listener every few seconds; without this hold, another
    process (a test running beside the soak, an outgoing connection's ephemeral port) could take
    the port meanwhile and the endpoint could not listen again. SO_REUSEPORT lets the endpoint's
    own listeners bind beside the hold; connections while none listens are refused."""
    hold = socket.socket()
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    hold.bind(("127.0.0.1", 0))
    return hold


# -- GPU processes that come and go --------------------------------------------------------


_CLK_TCK = os.sysconf("SC_CLK_TCK")  # /proc counts CPU and start times in these ticks


def _ticks(seconds: float) -> int:
    return math.floor(seconds * _CLK_TCK)


def process_name(pid: int) -> str:
    return PROCESS_NAMES[pid % len(PROCESS_NAMES)]


class Churn:
    """GPU processes appearing and exiting: NVML's list (the fake driver's state file) and
    their /proc entries, written so that every PID NVML lists has its entry."""

    def __init__(self, state_path: Path, procfs: Path, seed: int) -> None:
        self.state_path = state_path
        self.procfs = procfs
        self.rng = random.Random(seed)
        self.boot_seconds = math.floor(time.time()) - 86_400
        self.started = time.time()
        self.next_pid = 100_000
        self.live: list[deque[int]] = [deque() for _ in range(GPUS)]  # oldest first
        self.stats: dict[int, ProcessHostStats] = {}
        self.gpu_memory: dict[int, int] = {}
        self.appeared = 0
        self.exited = 0
        self.steps = 0
        self.error: BaseException | None = None
        for gpu in range(GPUS):
            for _ in range(PROCESSES_PER_GPU):
                self._spawn(gpu)
        self.appeared = 0
        self._write(gone=None)

    def _spawn(self, gpu: int) -> None:
        pid = self.next_pid
        self.next_pid += 1
        now = time.time()
        self.live[gpu].append(pid)
        self.gpu_memory[pid] = self.rng.randint(256, 4096) * MIB
        self.stats[pid] = ProcessHostStats(
            pid=pid,
            name=process_name(pid),
            cpu_seconds_total=0.0,
            resident_memory_bytes=self.rng.randint(200, 2000) * MIB,
            read_bytes_total=0,
            written_bytes_total=0,
            threads=self.rng.randint(4, 64),
            # whole clock ticks after boot: the exporter reads them back exactly
            create_time_seconds=self.boot_seconds + _ticks(now - self.boot_seconds) / _CLK_TCK,
        )
        self.appeared += 1

    def step(self) -> None:
        """One process on the next GPU exits and a new one takes its place."""
        gpu = self.steps % GPUS
        self.steps += 1
        gone = self.live[gpu].popleft()
        self.exited += 1
        self._spawn(gpu)
        for pid in self.live[gpu]:  # only this GPU's processes move: few files to rewrite
            s = self.stats[pid]
            self.stats[pid] = ProcessHostStats(
                pid=pid,
                name=s.name,
                cpu_seconds_total=s.cpu_seconds_total + self.rng.randint(1, 80) / _CLK_TCK,
                resident_memory_bytes=s.resident_memory_bytes,
                read_bytes_total=s.read_bytes_total + self.rng.randint(0, 64) * 4096,
                written_bytes_total=s.written_bytes_total + self.rng.randint(0, 8) * 4096,
                threads=s.threads,
                create_time_seconds=s.create_time_seconds,
            )
        self._write(gone)

    def _write(self, gone: int | None) -> None:
        # /proc first, still holding the process that leaves NVML's list now: an exporter that
        # read the list just before finds it. Its entry goes with the next write.
        processes = {pid: self.stats[pid] for pids in self.live for pid in pids}
        if gone is not None:
            processes[gone] = self.stats.pop(gone)
        write_procfs(
            self.procfs,
            self._host(time.time() - self.started),
            processes,
            boot_time_seconds=self.boot_seconds,
        )
        if gone is not None:
            del self.gpu_memory[gone]
        state: dict[str, object] = {"device_count": GPUS}
        for gpu, pids in enumerate(self.live):
            p = f"gpu{gpu}."
            state[p + "procs"] = [(pid, self.gpu_memory[pid]) for pid in pids]
            state[p + "procs_util"] = [(pid, 10 + pid % 60, 5 + pid % 30) for pid in pids]
            state[p + "memory.used"] = sum(self.gpu_memory[pid] for pid in pids)
            state[p + "utilization.gpu"] = self.rng.randint(20, 100)
        write_state(self.state_path, state)

    def _host(self, elapsed: float) -> HostSample:
        # Counters that advance with time, in the kernel's integer units; whole seconds only,
        # so the host files change once a second, not on every step.
        t = int(elapsed)
        tick = 1 / _CLK_TCK
        return HostSample(
            cpus=tuple(
                CpuTimes(i, 60 * t * tick, 0.0, 20 * t * tick, 20 * t * tick, 0.0, 0.0, 0.0, 0.0)
                for i in range(16)
            ),
            pressure=(
                PressureStall("cpu", 0.05, t * 0.05, None, None),
                PressureStall("io", 0.01, t * 0.01, 0.005, t * 0.005),
                PressureStall("memory", 0.0, 0.0, 0.0, 0.0),
            ),
            memory_total_bytes=128 * 1024 * MIB,
            memory_available_bytes=96 * 1024 * MIB,
            disks=(
                DiskCounters(
                    "nvme0n1", 100 * t, 10 * t, 100 * t * 4096, 10 * t * 4096, 0.0, 0.0, 0.0
                ),
            ),
            networks=(NetworkCounters("eth0", 10_000 * t, 5_000 * t, 10 * t, 5 * t, 0, 0, 0, 0),),
            tcp_out_segments_total=1000 * t,
            tcp_retransmitted_segments_total=t,
            load1=1.0,
        )

    def run(self, stop: threading.Event) -> None:
        period = 1 / CHURN_PER_SECOND
        due = time.monotonic()
        try:
            while not stop.is_set():
                self.step()
                due += period
                delay = due - time.monotonic()
                if delay > 0:
                    stop.wait(delay)
                else:  # fell behind (a loaded machine): go on at the rate, no burst
                    due = time.monotonic()
        except BaseException as exc:  # reported by the main loop, which stops the soak
            self.error = exc


# -- a vLLM endpoint that flaps ------------------------------------------------------------


class FlappingVllm:
    """vLLM's /metrics (two data-parallel engines) cycling through FLAP_PHASES."""

    def __init__(self, port: int, seed: int) -> None:
        self.port = port
        self.rng = random.Random(seed)
        self.mode = "up"
        self.served: Counter[str] = Counter()  # requests answered (or dropped), by mode
        self.phases: Counter[str] = Counter()
        registry = CollectorRegistry()
        self.registry = registry
        labels = ("engine", "model_name")
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting", labels, registry=registry
        )
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in batches", labels, registry=registry
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage", labels, registry=registry
        )
        self.preemptions = PromCounter(
            "vllm:num_preemptions", "Preemptions", labels, registry=registry
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Queue time",
            labels,
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5),
            registry=registry,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end latency",
            labels,
            buckets=(0.1, 0.5, 1, 5, 10, 30),
            registry=registry,
        )
        self.runner = web.AppRunner(self._app(), access_log=None)
        self.site: web.TCPSite | None = None

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        return app

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        mode = self.mode
        self.served[mode] += 1
        if mode == "down":  # a keep-alive connection opened while up: dropped, no answer
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=503)
        if mode == "slow":
            await asyncio.sleep(3 * SERVING_TIMEOUT_SECONDS)
        for engine in ("0", "1"):
            labels = (engine, "meta-llama/Llama-3.1-8B-Instruct")
            self.waiting.labels(*labels).set(self.rng.randint(0, 20))
            self.running.labels(*labels).set(self.rng.randint(0, 32))
            self.kv_usage.labels(*labels).set(self.rng.random())
            for _ in range(self.rng.randint(0, 5)):
                self.queue_time.labels(*labels).observe(self.rng.expovariate(20))
                self.e2e.labels(*labels).observe(self.rng.expovariate(1))
            if self.rng.random() < 0.1:
                self.preemptions.labels(*labels).inc()
        return web.Response(
            body=generate_latest(self.registry), content_type="text/plain", charset="utf-8"
        )

    async def _listen(self) -> None:
        self.site = web.TCPSite(
            self.runner, "127.0.0.1", self.port, reuse_address=True, reuse_port=True
        )
        await self.site.start()

    async def run(self, stop: asyncio.Event) -> None:
        await self.runner.setup()
        try:
            for mode, seconds in itertools.cycle(FLAP_PHASES):
                if mode == "down":
                    assert self.site is not None
                    await self.site.stop()  # new connections are refused
                    self.site = None
                elif self.site is None:
                    await self._listen()
                self.mode = mode
                self.phases[mode] += 1
                try:
                    await asyncio.wait_for(stop.wait(), seconds)
                    return
                except TimeoutError:
                    pass
        finally:
            await self.runner.cleanup()


# -- OTLP pushes ---------------------------------------------------------------------------


def _kv(key: str, value: str | int) -> KeyValue:
    kv = KeyValue(key=key)
    if isinstance(value, str):
        kv.value.string_value = value
    else:
        kv.value.int_value = value
    return kv


@dataclass
class _Cumulative:
    count: int = 0
    total: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0, 0, 0, 0])


class OtlpPusher:
    """8 custom workers, one per GPU, pushing their queues round robin, cumulative as the
    OpenTelemetry SDK sends them by default."""

    BOUNDS = (0.01, 0.1, 1.0)
    HISTOGRAMS = (
        ("gpubalance.batch.assembly_delay", "s"),
        ("gpubalance.batch.size", "{request}"),
        ("gpubalance.request.duration", "s"),
    )
    TENANTS = ("acme", "globex")

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.start_ns = time.time_ns()
        self.histograms: dict[tuple[int, str, str], _Cumulative] = {}
        self.failures = [0] * OTLP_WORKERS
        self.statuses: Counter[int] = Counter()
        self.rejected_points = 0
        self.errors: Counter[str] = Counter()

    def request(self, worker: int) -> bytes:
        now = time.time_ns()
        request = ExportMetricsServiceRequest()
        rm = request.resource_metrics.add()
        rm.resource.attributes.extend(
            [
                _kv("service.name", "gpubalance-worker"),
                _kv("service.instance.id", f"otlp-{worker}"),
                _kv("gpu.index", worker),
                _kv("gpubalance.class", "chat" if worker % 2 else "batch"),
            ]
        )
        sm = rm.scope_metrics.add()
        sm.scope.name = "gpubalance.instrument"
        depth = sm.metrics.add(name="gpubalance.queue.depth", unit="{request}")
        depth.gauge.data_points.add(as_int=self.rng.randint(0, 40), time_unix_nano=now)
        for name, unit in self.HISTOGRAMS:
            metric = sm.metrics.add(name=name, unit=unit)
            metric.histogram.aggregation_temporality = 2  # cumulative
            for tenant in self.TENANTS:
                c = self.histograms.setdefault((worker, name, tenant), _Cumulative())
                for _ in range(self.rng.randint(0, 4)):
                    value = self.rng.expovariate(10)
                    c.count += 1
                    c.total += value
                    c.buckets[sum(value > b for b in self.BOUNDS)] += 1
                point = metric.histogram.data_points.add(
                    count=c.count, sum=c.total, start_time_unix_nano=self.start_ns
                )
                point.time_unix_nano = now
                point.attributes.append(_kv("gpubalance.tenant", tenant))
                point.bucket_counts.extend(c.buckets)
                point.explicit_bounds.extend(self.BOUNDS)
        if self.rng.random() < 0.05:
            self.failures[worker] += 1
        failures = sm.metrics.add(name="gpubalance.memory.allocation_failures", unit="{failure}")
        failures.sum.aggregation_temporality = 2
        failures.sum.is_monotonic = True
        failures.sum.data_points.add(
            as_int=self.failures[worker], start_time_unix_nano=self.start_ns, time_unix_nano=now
        )
        return request.SerializeToString()

    async def run(self, url: str, stop: asyncio.Event) -> None:
        period = 1 / OTLP_PUSHES_PER_SECOND
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            due = time.monotonic()
            for n in itertools.count():
                if stop.is_set():
                    return
                body = self.request(n % OTLP_WORKERS)
                headers = {"Content-Type": "application/x-protobuf"}
                if n % 2:
                    body = gzip.compress(body)
                    headers["Content-Encoding"] = "gzip"
                try:
                    async with session.post(url, data=body, headers=headers) as response:
                        answer = await response.read()
                        self.statuses[response.status] += 1
                        if response.status == 200 and answer:
                            partial = ExportMetricsServiceResponse.FromString(answer)
                            self.rejected_points += partial.partial_success.rejected_data_points
                except (aiohttp.ClientError, TimeoutError) as exc:
                    self.errors[type(exc).__name__] += 1
                due += period
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                else:
                    due = time.monotonic()

    @property
    def ok(self) -> int:
        return self.statuses[200]


# -- scrapers ------------------------------------------------------------------------------


@dataclass
class ScrapeTally:
    requests: Counter[str] = field(default_factory=Counter)  # by path
    failures: Counter[str] = field(default_factory=Counter)  # "path: status or error"
    bytes_read: int = 0
    source_up_seen: Counter[str] = field(default_factory=Counter)  # the vllm source's up
    processes_listed: int = 0  # PIDs under the GPUs in a snapshot
    processes_attributed: int = 0  # of them, with host figures under the right name

    def check_snapshot(self, snapshot: dict[str, Any]) -> None:
        sample = snapshot["sample"]
        host = sample.get("processes") or {}
        for gpu in sample["gpus"]:
            for process in gpu.get("processes") or ():
                pid = process["pid"]
                self.processes_listed += 1
                found = host.get(str(pid))
                if found is not None and found["name"] == process_name(pid):
                    self.processes_attributed += 1


def scrape_paths(history: int) -> tuple[str, ...]:
    return (
        "/metrics",
        "/api/v1/snapshot",
        "/metrics?names=dcgm",
        f"/api/v1/snapshot?history={history}",
        "/metrics?names=both",
    )


async def scrape(
    url: str, paths: tuple[str, ...], index: int, tally: ScrapeTally, stop: asyncio.Event
) -> None:
    # Scrapers 0 and 1 keep their connection; 2 and 3 open one per request, as a scraper
    # behind a proxy does, which is where a socket left unclosed would show.
    connector = aiohttp.TCPConnector(force_close=index >= 2)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for n in itertools.count(index):
            if stop.is_set():
                return
            path = paths[n % len(paths)]
            # aiohttp asks for gzip by default: every other request asks for plain text
            headers = {"Accept-Encoding": "gzip" if n % 2 else "identity"}
            try:
                async with session.get(url + path, headers=headers) as response:
                    body = await response.read()
                    tally.requests[path] += 1
                    tally.bytes_read += len(body)
                    if response.status != 200:
                        tally.failures[f"{path}: {response.status}"] += 1
                    elif path == "/metrics":
                        tally.source_up_seen.update(SOURCE_UP.findall(body.decode()))
                    elif path == "/api/v1/snapshot":
                        tally.check_snapshot(json.loads(body))
            except (aiohttp.ClientError, TimeoutError) as exc:
                tally.failures[f"{path}: {type(exc).__name__}"] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SCRAPE_PAUSE_SECONDS)


# -- the exporter and its readings ---------------------------------------------------------


@dataclass
class Exporter:
    process: subprocess.Popen[bytes]
    url: str
    otlp_url: str
    log_path: Path


def start_exporter(run_dir: Path, library_dir: Path, churn: Churn, args: Any) -> Exporter:
    serving_port = args.serving_port
    config = run_dir / "exporter.yaml"
    config.write_text(
        "exporter:\n"
        "  serving:\n"
        f"    timeout: {SERVING_TIMEOUT_SECONDS}\n"
        "    endpoints:\n"
        f'      - {{url: "http://127.0.0.1:{serving_port}/metrics", format: vllm,'
        " worker: vllm-0, gpus: [0, 1], class: chat}\n"
    )
    otlp_listen = f"127.0.0.1:{free_port()}" if otlp_has_own_listener() else None
    command = [
        sys.executable,
        "-m",
        "gpubalance",
        "exporter",
        "--config",
        str(config),
        "--listen",
        "127.0.0.1:0",
        "--interval",
        str(args.interval),
        "--window",
        str(args.window),
        "--trend-window",
        str(args.trend_window),
        "--procfs",
        str(churn.procfs),
        *(["--otlp-listen", otlp_listen] if otlp_listen else []),
    ]
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": os.pathsep.join(
            p for p in (str(library_dir), os.environ.get("LD_LIBRARY_PATH")) if p
        ),
        "FAKE_NVML_STATE": str(churn.state_path),
    }
    log_path = run_dir / "exporter.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    otlp_port = otlp_listen.rpartition(":")[2] if otlp_listen else None
    url = None
    while url is None:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the exporter did not start:\n{log_path.read_text()}")
        # the OTLP listener may say "listening on" too: the scrape URL is the other one
        for match in LISTENING.finditer(log_path.read_text(errors="replace")):
            if match.group(2) != otlp_port:
                url = match.group(1)
        time.sleep(0.1)
    # the load starts once there is a sample to serve: before it, /metrics answers 503
    while not _healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the exporter took no sample:\n{log_path.read_text()}")
        time.sleep(0.1)
    return Exporter(process, url, otlp_push_url(url, otlp_listen), log_path)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=5) as response:
            return response.status == 200
    except OSError:  # refused, or an HTTPError (503 until the first sample)
        return False


@dataclass(frozen=True)
class Reading:
    seconds: float  # since the load started
    rss_bytes: int
    fds: int
    threads: int
    cpu_seconds: float  # the exporter's user + system time so far
    otlp_pushes_ok: int
    processes_appeared: int
    scrapes: int
    load1: float  # the machine's load average: it is shared, and says how busy it was


@dataclass(frozen=True)
class Fit:
    """A Theil-Sen line over the readings after the warm-up."""

    slope_per_minute: float
    growth: float  # the line's rise over the span after the warm-up
    first: float
    last: float
    low: float
    high: float
    early_median: float  # of the first third of those readings
    late_median: float  # of the last third
    # the rise over the span after the warm-up at the slope of its last half (a leak keeps its
    # pace; a filling heap levels off)
    late_growth: float


def theil_sen(t: np.ndarray, y: np.ndarray) -> float:
    """The median of the slopes between every pair of readings."""
    i, j = np.triu_indices(len(t), k=1)
    return float(np.median((y[j] - y[i]) / (t[j] - t[i])))


def fit(readings: list[Reading], attribute: str, warmup_seconds: float) -> Fit:
    after = [r for r in readings if r.seconds >= warmup_seconds]
    t = np.array([r.seconds for r in after])
    y = np.array([float(getattr(r, attribute)) for r in after])
    slope = theil_sen(t, y)
    half = len(t) // 2
    late = theil_sen(t[half:], y[half:]) if len(t) - half >= 2 else slope
    return Fit(
        slope_per_minute=slope * 60,
        growth=slope * float(t[-1] - t[0]),
        late_growth=late * float(t[-1] - t[0]),
        first=float(y[0]),
        last=float(y[-1]),
        low=float(y.min()),
        high=float(y.max()),
        early_median=float(np.median(y[: max(1, len(y) // 3)])),
        late_median=float(np.median(y[-max(1, len(y) // 3) :])),
    )


def read(process: psutil.Process) -> tuple[int, int, int, float]:
    with process.oneshot():
        cpu = process.cpu_times()
        return (
            process.memory_info().rss,
            process.num_fds(),
            process.num_threads(),
            cpu.user + cpu.system,
        )


async def soak(exporter: Exporter, churn: Churn, args: Any) -> dict[str, Any]:
    stop = asyncio.Event()
    churn_stop = threading.Event()
    vllm = FlappingVllm(args.serving_port, args.seed)
    pusher = OtlpPusher(args.seed + 1)
    tally = ScrapeTally()
    churner = threading.Thread(target=churn.run, args=(churn_stop,), name="churn", daemon=True)
    tasks = [
        asyncio.create_task(vllm.run(stop)),
        asyncio.create_task(pusher.run(exporter.otlp_url, stop)),
    ]
    paths = scrape_paths(min(SNAPSHOT_HISTORY, int(args.trend_window / args.interval)))
    tasks += [
        asyncio.create_task(scrape(exporter.url, paths, n, tally, stop)) for n in range(SCRAPERS)
    ]
    churner.start()
    target = psutil.Process(exporter.process.pid)
    readings: list[Reading] = []
    count = int(args.minutes * 60 / args.sample_every) + 1
    started = time.monotonic()
    died = None
    try:
        with progress(f"soak, {args.minutes:g} min", count) as advance:
            for n in range(count):
                delay = started + n * args.sample_every - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if exporter.process.poll() is not None:
                    died = f"the exporter exited with status {exporter.process.returncode}"
                    break
                if churn.error is not None:
                    raise RuntimeError("the churn writer failed") from churn.error
                rss, fds, threads, cpu = read(target)
                readings.append(
                    Reading(
                        round(time.monotonic() - started, 2),
                        rss,
                        fds,
                        threads,
                        round(cpu, 2),
                        pusher.ok,
                        churn.appeared,
                        sum(tally.requests.values()),
                        os.getloadavg()[0],
                    )
                )
                advance()
    finally:
        stop.set()
        churn_stop.set()
        await asyncio.gather(*tasks)
        churner.join(10)
    elapsed = time.monotonic() - started
    load = {
        "seconds": round(elapsed, 1),
        "processes_appeared": churn.appeared,
        "processes_exited": churn.exited,
        "processes_listed": tally.processes_listed,
        "processes_attributed": tally.processes_attributed,
        "otlp_url": exporter.otlp_url,
        "otlp_statuses": dict(pusher.statuses),
        "otlp_errors": dict(pusher.errors),
        "otlp_rejected_points": pusher.rejected_points,
        "scrapes": dict(tally.requests),
        "scrape_failures": dict(tally.failures),
        "scrape_bytes": tally.bytes_read,
        "serving_served": dict(vllm.served),
        "serving_phases": dict(vllm.phases),
        "serving_up_seen": dict(tally.source_up_seen),
    }
    return {"readings": readings, "load": load, "died": died}


def verdict(result: dict[str, Any], args: Any) -> tuple[dict[str, Fit], list[str]]:
    readings: list[Reading] = result["readings"]
    warmup = args.warmup * 60
    problems = []
    if result["died"]:
        problems.append(result["died"])
    if sum(r.seconds >= warmup for r in readings) < 3:
        problems.append("fewer than 3 readings after the warm-up: nothing to fit")
        return {}, problems
    fits = {name: fit(readings, name, warmup) for name in ("rss_bytes", "fds", "threads")}
    bound = args.max_rss_growth_mib * MIB
    rss = fits["rss_bytes"]
    if rss.growth >= bound and rss.late_growth >= bound:
        problems.append(
            f"RSS grew {rss.growth / MIB:.2f} MiB after the warm-up and still grows at its end"
            f" ({rss.late_growth / MIB:.2f} MiB at the pace of its last half; bound"
            f" {args.max_rss_growth_mib:g} MiB)"
        )
    for name in ("fds", "threads"):
        if fits[name].growth >= 1:
            problems.append(f"{name} grew {fits[name].growth:.1f} after the warm-up (bound 1)")
    load = result["load"]
    if load["scrape_failures"]:
        problems.append(f"failed scrapes: {load['scrape_failures']}")
    refused = {k: v for k, v in load["otlp_statuses"].items() if k != 200}
    if refused or load["otlp_errors"] or load["otlp_rejected_points"]:
        problems.append(
            f"OTLP pushes not taken: statuses {refused}, errors {load['otlp_errors']},"
            f" rejected points {load['otlp_rejected_points']}"
        )
    return fits, problems


# -- the report ----------------------------------------------------------------------------


def summary_line(fits: dict[str, Fit], result: dict[str, Any], problems: list[str]) -> str:
    load = result["load"]
    seconds = load["seconds"] or 1
    parts = [
        f"soak {seconds / 60:.1f} min:",
        f"{load['processes_appeared'] / seconds:.1f} processes/s appeared,",
        f"{load['otlp_statuses'].get(200, 0) / seconds:.1f} OTLP pushes/s,",
        f"{sum(load['scrapes'].values()) / seconds:.1f} scrapes/s;",
    ]
    if fits:
        parts.append(
            f"after warm-up RSS {fits['rss_bytes'].first / MIB:.1f} -> "
            f"{fits['rss_bytes'].last / MIB:.1f} MiB (fit {fits['rss_bytes'].growth / MIB:+.2f}"
            f" MiB), fds {fits['fds'].low:.0f}-{fits['fds'].high:.0f} (fit"
            f" {fits['fds'].growth:+.1f}), threads {fits['threads'].low:.0f}-"
            f"{fits['threads'].high:.0f} (fit {fits['threads'].growth:+.1f});"
        )
    parts.append("PASS" if not problems else "FAIL: " + "; ".join(problems))
    return " ".join(parts)


def plot(readings: list[Reading], fits: dict[str, Fit], args: Any, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = np.array([r.seconds / 60 for r in readings])
    series = (
        ("rss_bytes", "RSS (MiB)", 1 / MIB),
        ("fds", "open fds", 1.0),
        ("threads", "threads", 1.0),
    )
    figure, axes = plt.subplots(len(series), 1, figsize=(8, 7), sharex=True)
    for ax, (name, label, scale) in zip(axes, series, strict=True):
        values = np.array([getattr(r, name) for r in readings]) * scale
        ax.plot(minutes, values, ".-", markersize=3, linewidth=0.8)
        ax.axvspan(0, args.warmup, color="0.9", label="warm-up")
        after = minutes >= args.warmup
        # Theil-Sen's line passes through the median of the residual intercepts
        slope = fits[name].slope_per_minute * scale
        intercept = float(np.median(values[after] - slope * minutes[after]))
        line = intercept + slope * minutes[after]
        ax.plot(minutes[after], line, "--", color="C3", linewidth=1, label="Theil-Sen fit")
        ax.set_ylabel(label)
        low, high = values.min(), values.max()
        pad = max((high - low) * 0.2, 1.0 if name != "rss_bytes" else 2.0)
        ax.set_ylim(low - pad, high + pad)
    axes[0].legend(loc="lower right")
    axes[-1].set_xlabel("minutes")
    axes[0].set_title("gpubalance exporter under churn: 8 GPUs, 10 processes/s, 50 OTLP/s")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def results_section(
    fits: dict[str, Fit], result: dict[str, Any], problems: list[str], args: Any, context: str
) -> str:
    load = result["load"]
    readings: list[Reading] = result["readings"]
    seconds = load["seconds"]
    attributed = (
        load["processes_attributed"] / load["processes_listed"] if load["processes_listed"] else 0
    )
    flaps = ", ".join(f"{k} {v}" for k, v in sorted(load["serving_phases"].items()))
    up_seen = ", ".join(f"{k} {v}" for k, v in sorted(load["serving_up_seen"].items()))
    lines = [
        f"`python bench/soak.py --minutes {args.minutes:g} --warmup {args.warmup:g}`. " + context,
        "",
        ANCHOR,
        "",
        "Load, all on 127.0.0.1, measured over the run: the real exporter process"
        f" (`--interval {args.interval:g} --window {args.window:g} --trend-window"
        f" {args.trend_window:g}`) on the fake NVML driver with {GPUS} GPUs and a fake procfs"
        f" tree; {load['processes_appeared'] / seconds:.1f} GPU processes/s appeared and as many"
        f" exited ({load['processes_appeared']} new PIDs, {PROCESSES_PER_GPU} per GPU at a time),"
        f" {attributed:.1%} of those listed in snapshots attributed to their /proc entry;"
        f" {load['otlp_statuses'].get(200, 0) / seconds:.1f} OTLP/HTTP pushes/s taken"
        f" (protobuf, half gzip, {OTLP_WORKERS} workers, to `{_path_of(load['otlp_url'])}` on"
        f" {'its own listener' if load['otlp_own_listener'] else 'the scrape port'});"
        f" {SCRAPERS} scrapers, {sum(load['scrapes'].values()) / seconds:.1f} requests/s on"
        f" {', '.join(f'`{p}`' for p in load['scrapes'])} ({load['scrape_bytes'] / 1e9:.2f} GB"
        f" read), failures: {sum(load['scrape_failures'].values())}; a vLLM endpoint flapping"
        f" up / slow / down (phases: {flaps}), the exporter's `gpubalance_serving_source_up`"
        f" seen as {up_seen}.",
        "",
        "| after the warm-up | first | last | min | max | median, first third | median, last"
        " third | Theil-Sen growth | bound | |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    bounds = {"rss_bytes": args.max_rss_growth_mib * MIB, "fds": 1, "threads": 1}
    for name, label, scale, unit, digits in (
        ("rss_bytes", "RSS", 1 / MIB, " MiB", 1),
        ("fds", "open fds", 1, "", 0),
        ("threads", "threads", 1, "", 0),
    ):
        f = fits[name]
        values = (f.first, f.last, f.low, f.high, f.early_median, f.late_median)
        cells = " | ".join(f"{v * scale:.{digits}f}{unit}" for v in values)
        if f.growth < bounds[name]:
            status = "met"
        elif name == "rss_bytes" and f.late_growth < bounds[name]:
            status = f"levelled off (last half's pace: {f.late_growth * scale:+.2f}{unit})"
        else:
            status = "**not met**"
        lines.append(
            f"| {label} | {cells} | {f.growth * scale:+.2f}{unit} |"
            f" < {bounds[name] * scale:g}{unit} | {status} |"
        )
    lines += [
        "",
        "Per minute (the reading nearest each whole minute; CPU is the exporter's share of one"
        " core over the minute before):",
        "",
        "| minute | RSS MiB | open fds | threads | CPU | OTLP pushes taken | new GPU processes |"
        " requests served | load average |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    previous: Reading | None = None
    for minute in range(int(readings[-1].seconds // 60) + 1):
        r = min(readings, key=lambda x: abs(x.seconds - 60 * minute))
        cpu = (
            f"{(r.cpu_seconds - previous.cpu_seconds) / (r.seconds - previous.seconds):.0%}"
            if previous is not None and r.seconds > previous.seconds
            else "–"
        )
        lines.append(
            f"| {minute} | {r.rss_bytes / MIB:.1f} | {r.fds} | {r.threads} | {cpu} |"
            f" {r.otlp_pushes_ok} | {r.processes_appeared} | {r.scrapes} | {r.load1:.1f} |"
        )
        previous = r
    lines += [
        "",
        "The exporter's threads are its main thread, the sampler, one NVML reader per GPU"
        f" ({GPUS}) and the workers that decode OTLP pushes and parse serving scrapes,"
        " all started with the exporter: min(32, CPUs + 4),"
        f" {min(32, (os.cpu_count() or 1) + 4)} here.",
        "",
        "Verdict: " + ("met" if not problems else "**not met**: " + "; ".join(problems)) + ".",
        "",
        "![RSS, fds and threads over the soak](soak.png)",
    ]
    return "\n".join(lines)


def _path_of(url: str) -> str:
    return "/" + url.split("/", 3)[3]


def machine_context(note: str, load_before: float, load_after: float) -> str:
    memory_gib = psutil.virtual_memory().total / 1024**3
    text = (
        f"Run {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC on"
        f" {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs,"
        f" {memory_gib:.0f} GiB, Linux {platform.release()}, Python {platform.python_version()};"
        f" load average {load_before:.1f} at the start and {load_after:.1f} at the end."
    )
    return text + (f" {note}" if note else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=5.0, metavar="MINUTES")
    parser.add_argument("--sample-every", type=float, default=10.0, metavar="SECONDS")
    parser.add_argument("--max-rss-growth-mib", type=float, default=5.0)
    parser.add_argument("--interval", type=float, default=1.0, help="the exporter's --interval")
    parser.add_argument("--window", type=float, default=30.0, help="the exporter's --window")
    parser.add_argument(
        "--trend-window", type=float, default=300.0, help="the exporter's --trend-window"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fakenvml-dir",
        type=Path,
        default=ROOT / "build" / "fakenvml",
        help="where the fake driver is (built there when missing or stale)",
    )
    parser.add_argument("--json", type=Path, help="write every reading and the load here")
    parser.add_argument(
        "--no-results", action="store_true", help="leave bench/RESULTS.md and soak.png alone"
    )
    parser.add_argument("--note", default="", help="a sentence for RESULTS.md about the machine")
    args = parser.parse_args()
    if args.warmup * 60 < args.trend_window:
        parser.error("--warmup must cover --trend-window: the history fills during the warm-up")
    if (args.minutes - args.warmup) * 60 < 3 * args.sample_every:
        parser.error("need at least 3 readings after --warmup: raise --minutes")

    # Stopped by SIGTERM (a CI timeout, kill), it still stops its exporter and removes its files.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    library_dir = build_library(args.fakenvml_dir).parent
    shm = Path("/dev/shm")  # tmpfs: the procfs tree is rewritten 10 times a second
    run_dir = Path(tempfile.mkdtemp(prefix="gpubalance-soak-", dir=shm if shm.is_dir() else None))
    load_before = os.getloadavg()[0]
    port_hold = held_port()
    args.serving_port = port_hold.getsockname()[1]
    exporter = None
    try:
        procfs = run_dir / "proc"
        procfs.mkdir()
        churn = Churn(run_dir / "nvml.state", procfs, args.seed)
        exporter = start_exporter(run_dir, library_dir, churn, args)
        result = asyncio.run(soak(exporter, churn, args))
        result["load"]["otlp_own_listener"] = not exporter.otlp_url.startswith(exporter.url)
        log_tail = exporter.log_path.read_text(errors="replace").splitlines()[-20:]
    finally:
        if exporter is not None and exporter.process.poll() is None:
            exporter.process.terminate()
            try:
                exporter.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                exporter.process.kill()
                exporter.process.wait()
        port_hold.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    fits, problems = verdict(result, args)
    line = summary_line(fits, result, problems)
    print(line)
    if result["died"]:
        print("\n".join(log_tail), file=sys.stderr)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "summary": line,
                    "passed": not problems,
                    "problems": problems,
                    "fits": {k: asdict(v) for k, v in fits.items()},
                    "load": result["load"],
                    "readings": [asdict(r) for r in result["readings"]],
                },
                indent=1,
            )
        )
    if not args.no_results and fits:
        context = machine_context(args.note, load_before, os.getloadavg()[0])
        plot(result["readings"], fits, args, BENCH / "soak.png")
        write_section(
            "soak",
            "Soak: the exporter's RSS, open fds and threads under churn",
            results_section(fits, result, problems, args, context),
        )
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
