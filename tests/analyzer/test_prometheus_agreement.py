"""A live lab run seen two ways: the exporter's snapshot history, and a real Prometheus that
scraped the same exporter twice a second. Both give the same frames, the same features and the
same ranking of the GPUs, within one window.

"Within one window": Prometheus stores what the exporter last sampled at each scrape, stamped
with the scrape's time, so its windows see the exporter's samples up to one sampling interval
late (a tenth of a 10 s window here). A Prometheus figure therefore agrees when it lies within
the tolerance of the band its own window's snapshot figure and the neighbouring windows' span.

Prometheus scrapes twice per sample. At one scrape per sample the scrapes keep one phase
against the samples for the whole run (Prometheus offsets each target within the interval by a
hash of its labels); where that phase lies near the samples' own, a loaded machine's jitter
makes scrapes miss a sample and see its neighbour twice in most windows (83 of 85 in one round
of 30 beside a busy core), and too few windows are left to compare.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import math
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

import numpy as np
import pytest
from harness import Metrics

from gpubalance.analyzer.features import COLUMNS, QUEUED_BATCHES, FeatureBuilder, FeatureTable
from gpubalance.analyzer.frames import GpuFrame, window_index
from gpubalance.analyzer.prometheus import PrometheusSource
from gpubalance.analyzer.sources import (
    ExporterSource,
    FrameSource,
    Recording,
    SourceError,
    complete_windows,
    exporter_recording,
    open_source,
)
from gpubalance.lab import scenario, traffic
from gpubalance.lab.live.ports import start_prometheus
from gpubalance.lab.live.run import LiveLab
from gpubalance.telemetry import Sample

pytestmark = [
    pytest.mark.live,  # a live lab run, scraped by the exporter and a real Prometheus
    pytest.mark.skipif(
        shutil.which("haproxy") is None and not Path("/usr/sbin/haproxy").exists(),
        reason="HAProxy: sudo apt-get install haproxy",
    ),
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="apt-get install prometheus"),
    pytest.mark.timeout(1200),
]

FIXTURES = Path(__file__).parent / "fixtures"
WINDOW = 10.0
INTERVAL = 1.0  # the exporter samples every second
SCRAPE_INTERVAL = INTERVAL / 2  # Prometheus scrapes twice as often: no sample missed
SNAPSHOT_AFTER_SAMPLES = 85  # what the exporter holds at least when its history is taken
# samples asked for at each look: the exporter keeps 302 (its 300 s trend window). The looks'
# samples are kept together: on a busy machine windows are often short of a sample either
# way, and those compared both ways are spread over the whole run, not its last 30 windows
HISTORY = 300
# ... and the windows it and Prometheus cover whole on every GPU (10 samples of 10) that the
# run waits for: the frames' comparison needs 5 per GPU, the features' 4 after the start-up
WHOLE_WINDOWS = 8
# the first whole windows, as the workers take their first requests: no feature's past
START_UP_WINDOWS = 2
# the most the lab runs: the exporter skips the ticks it is late for, so on a busy machine its
# windows fill later than 10 s each, and fewer are whole both ways; the run is stopped once
# they are taken and scraped (on an idle machine after some 100 s)
DURATION = 840.0
T = TypeVar("T")

# Tolerances (absolute, relative) on top of the band the neighbouring windows span. Each sample
# is a tenth of a window: one that lands in the neighbouring window, or is scraped twice while
# its successor is missed, moves a mean by up to a tenth of the samples' spread.
FRAME_TOLERANCES: dict[str, tuple[float, float]] = {
    "sample_count": (2, 0),  # a sample more or less at each edge (scrapes: see _sample_share)
    "utilization_mean_ratio": (0.1, 0),
    "utilization_p95_ratio": (0.1, 0),  # see _p95_agrees
    "memory_used_bytes": (0, 0.02),
    "memory_total_bytes": (0, 0),
    "sm_clock_ratio": (0.02, 0),
    "throttled_ratio": (0.1, 0),
    "power_ratio": (0.1, 0),
    "temperature_celsius": (1.0, 0),  # a warming card gains about a degree a second
    "queue_depth_mean": (0.5, 0.15),
    "queue_depth_max": (1.0, 0.2),
    "queue_depth_slope_per_second": (0.05, 0),  # plus a share of the queue: see _tolerance
    "running_mean": (0.5, 0.15),
    "kv_cache_usage_ratio": (0.05, 0.15),
    # increase() sees the window's own samples: the requests of the second before its first
    # scrape (a tenth of them, some 3 of GPU 1's 28) are in no window's mean, where the
    # snapshots difference against the sample before the window
    "batch_delay_seconds": (0.01, 0.35),
    "request_duration_seconds": (0.02, 0.25),
    "batch_size_mean": (0.3, 0.2),
    # and it extrapolates them to the window's edges: rates agree closer than means
    "completions_per_second": (0.3, 0.15),
    "prompt_tokens_per_second": (50.0, 0.15),
    "generation_tokens_per_second": (20.0, 0.15),
    "allocation_failures": (0.5, 0),
    "feeder_cpu_cores_max": (0.1, 0.15),
    "host_cpu_busy_ratio": (0.05, 0),
    "host_cpu_pressure_ratio": (0.05, 0),
    "host_io_pressure_ratio": (0.05, 0),
    "host_iowait_ratio": (0.05, 0),
}
# labels rather than measurements: the same as in one of the neighbouring windows
FRAME_EQUAL = (
    "card",
    "gpu",
    "lost",
    "serving_queues",
    "queue_names",
    "service_classes",
    "feeder_processes",
    "throttle_reasons",
)
# features are ratios of the figures above, with their tolerances: queues in batches (the
# largest batch is at least one request), throughput against peers and own best as ratios of
# two rates; peer z-scores divide by a floor of 0.02, so a 0.05 difference in utilization
# moves them by 2.5
FEATURE_TOLERANCES: dict[str, tuple[float, float]] = {
    name: (3.0, 0.2) if name.endswith("_z") else (0.1, 0.15) for name in COLUMNS
}
FEATURE_TOLERANCES.update(
    {
        "utilization_p95_ratio": FRAME_TOLERANCES["utilization_p95_ratio"],
        "queue_batches": (0.5, 0.15),
        "pool_queue_batches_mean": (0.5, 0.15),
        "queue_max_batches": (1.0, 0.2),
        "peer_queue_max_batches": (1.0, 0.2),
        "queue_slope_batches_per_window": (0.1, 0),  # plus a share of the queue
        "throughput_vs_peers_ratio": (0.1, 0.4),
        "throughput_vs_own_best_ratio": (0.1, 0.3),
        # a mean over the requests each source sees answered in the window
        "prompt_tokens_per_request": (5.0, 0.25),
        "generation_tokens_per_request": (2.0, 0.25),
    }
)
# estimates against a capacity from the GPU's own past (its best, its batch-time fit): as the
# own-best ratio, each source's frames with their own past
FEATURE_TOLERANCES.update(
    {
        name: (0.1, 0.3)
        for name in COLUMNS
        if "rho" in name
        or name.startswith(("capacity_", "work_share_", "batch_time_", "batch_fit_"))
    }
)
# features of figures the Prometheus source does not query (per-class durations),
# and rho against the best a GPU served with work waiting: that best is whatever saturated
# window each source's own past holds, and the Prometheus range starts with none; likewise the
# means over a GPU's last windows, which begin with the source's range (known gap)
SNAPSHOT_ONLY = {
    "class_duration_ratio",
    "rho_estimate_ratio",
    "offered_rho_estimate_ratio",
    "peer_rho_estimate_max",
    "peer_rho_estimate_min",
    "pool_rho_estimate_mean",
    "rho_estimate_recent_mean",
    "queue_batches_previous",
    "queue_batches_recent_mean",
    "effective_utilization_previous",
    "effective_utilization_recent_mean",
}
# features that cut a queue at QUEUED_BATCHES: where the queue they cut lies within its
# tolerance of the cut, one sample flips them, and they are not compared in that window
CUTS = {"pool_busy_share": "queue_batches", "idle_while_peer_queued": "peer_queue_max_batches"}
# the batch-time fit behind these is known once a card of the pool has a batch point, and
# rests on each source's own past: each source's means differ a little (counters' increases
# against the snapshots' differences), and one source can have its first point a window before
# the other (a clean-clone make test, once, when the fit needed spread sizes). Known on one
# side only agrees; known on both, the values are compared
FITS = {
    "rho_fitted_ratio",
    "peer_rho_fitted_max",
    "pool_rho_fitted_mean",
    "pool_fair_rho_fitted_ratio",
    "batch_time_exponent",
    "batch_fit_measured_ratio",
}
# A least-squares slope over a window's n samples gives an end sample of height q the weight
# q·(n-1)/2 / Σ(t - t̄)²: a sample of the queue's largest height leaving one end as another
# enters at the other moves the slope by twice that (0.109 of the height per second for ten).
_N = round(WINDOW / INTERVAL)
SLOPE_PER_HEIGHT = 2 * (_N - 1) / 2 / sum((i - (_N - 1) / 2) ** 2 for i in range(_N)) / INTERVAL


def wait_until(check: Callable[[], T | None], seconds: float, what: str) -> T:
    """``check()``'s first answer that is not None, within ``seconds``."""
    deadline = time.monotonic() + seconds
    while (answer := check()) is None:
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.2)
    return answer


@dataclass
class Prometheus:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def api(self, path: str, **params: str) -> Any:
        assert self.process.poll() is None, f"Prometheus died:\n{self.log_path.read_text()}"
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as answer:
            return json.load(answer)["data"]


@pytest.fixture
def prometheus_for(tmp_path: Path) -> Iterator[Callable[[str], Prometheus]]:
    """prometheus_for(target): a Prometheus scraping ``target`` twice a second."""
    started: list[Prometheus] = []

    def start(target: str) -> Prometheus:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            # Prometheus' durations are whole numbers of a unit
            f"global: {{scrape_interval: {SCRAPE_INTERVAL * 1000:.0f}ms, "
            f"scrape_timeout: {SCRAPE_INTERVAL * 1000:.0f}ms}}\n"
            "scrape_configs:\n"
            f"  - job_name: gpubalance\n    static_configs: [{{targets: ['{target}']}}]\n"
        )
        server = start_prometheus(config, tmp_path / "tsdb")
        started.append(Prometheus(server.process, server.url, server.log_path))
        return started[-1]

    yield start
    for prometheus in started:
        prometheus.process.terminate()
        prometheus.process.wait(timeout=30)


@dataclass
class Seen:
    recording: Recording
    prometheus: Prometheus
    exporter_source: FrameSource  # what open_source made of the exporter's URL
    exporter_frames: list[GpuFrame]  # and the frames it gave, a moment after the recording
    target: str  # the exporter's address, Prometheus' instance label


def scraped_samples(prometheus: Prometheus, first: float, last: float) -> set[float]:
    """Which of the exporter's samples Prometheus' scrapes saw: the values of the last
    sample's timestamp that its scrapes stored. A scrape ahead of the exporter's next sample
    sees the one before again, and the one after then skips a sample (or more, on a busy
    machine)."""
    seconds = math.ceil(last - first + 2 * WINDOW)
    result = prometheus.api(
        "query",
        query=f"gpubalance_exporter_last_sample_timestamp_seconds[{seconds}s]",
        time=f"{last + WINDOW:.3f}",
    )["result"]
    return {round(float(value), 3) for series in result for _, value in series["values"]}


def missed(recording: Recording, seen: set[float]) -> set[int]:
    """The windows holding an exporter sample no scrape saw. A missed sample is no difference
    between the two views: a queue's peak in it is in no Prometheus window. (One a scrape of
    the next window saw is the one-sample lag the ``lagging`` windows cover: on a busy machine
    the exporter publishes a sample a while after its timestamp.)"""
    return {
        window_index(s.timestamp_seconds, 0.0, WINDOW)
        for s in recording.samples
        if round(s.timestamp_seconds, 3) not in seen
    }


def run_seen_twice(fakenvml_dir: Path, prometheus_for: Callable[[str], Prometheus]) -> Seen:
    """The skewed demo server live, scraped by Prometheus; the exporter's history taken once
    it covers six whole windows in a row on every GPU, Prometheus waited for until it has them
    too, then the run stopped."""
    plan = scenario.load("skewed-heterogeneous")
    requests = traffic.generate(plan.scenario.traffic, DURATION, plan.scenario.seed)
    ready = threading.Event()
    lab = LiveLab(
        plan,
        requests,
        DURATION,
        start_exporter=True,
        exporter_args=("--interval", f"{INTERVAL:g}", "--window", f"{INTERVAL:g}"),
        build_dir=fakenvml_dir,
        on_ready=lambda _: ready.set(),
    )
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(lab.run())
        except BaseException as exc:  # handed to the test below
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert ready.wait(120), "the live lab did not start"
        assert lab.exporter is not None
        # its port is known once it listens (one another process took is changed at start)
        prometheus = prometheus_for(f"127.0.0.1:{lab.exporter_port}")
        url = lab.exporter.url

        def exporter_samples() -> float | None:
            try:
                with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
                    metrics = Metrics.parse(answer.read().decode())
            except (urllib.error.URLError, ConnectionError):
                return None  # the lab is up before its exporter listens: wait on, bounded

            taken = metrics.value("gpubalance_exporter_samples_total")
            return taken if taken >= SNAPSHOT_AFTER_SAMPLES else None

        wait_until(exporter_samples, DURATION, "the exporter's samples")

        # the last look's windows (snapshots, Prometheus', those holding a sample no scrape
        # saw, the run's seconds): what a lab that ended first had reached, said only then
        looked: list[Look] = []
        # the samples of every look so far, by time: the run's whole recording
        taken: dict[float, Sample] = {}

        def ended() -> str:
            standing = _standing(prometheus, looked[-1]) if looked else "no look yet"
            return (
                f"the lab's {DURATION:g} s ended before the windows: {WHOLE_WINDOWS} per GPU "
                f"wanted; at the last look {standing}"
            )

        def whole_windows() -> Recording | None:
            assert thread.is_alive(), ended()
            try:
                latest = exporter_recording(url, HISTORY, timeout=30)
            except SourceError as exc:  # the lab's exporter stops as the lab ends
                raise AssertionError(f"{ended()} ({exc})") from None
            taken.update((s.timestamp_seconds, s) for s in latest.samples)
            recording = dataclasses.replace(latest, samples=tuple(taken[t] for t in sorted(taken)))
            last = recording.samples[-1].timestamp_seconds
            frames = list(complete_windows(recording.frames(WINDOW), last))
            snapshots = _by_window(frames)
            # ... and Prometheus scraped all through them: on a busy machine a scrape times
            # out now and then, and a window short of one has too few samples for increase()
            # (which extrapolates at most half a scrape interval past its edges)
            source = open_source(prometheus.url)
            scraped = _by_window(source.frames(frames[0].t_start, last, WINDOW))
            seen = scraped_samples(prometheus, frames[0].t_start, last)
            gaps = missed(recording, seen)
            compared = _comparable(snapshots, scraped, gaps)
            both = Counter(uuid for uuid, _ in compared)
            looked[:] = [Look(snapshots, scraped, gaps, last - frames[0].t_start)]
            if len(both) == 4 and min(both.values()) >= WHOLE_WINDOWS:
                return recording
            # a window fills in 10 s: asking more often only takes the CPU the exporter's
            # samples need on a busy machine
            time.sleep(WINDOW)
            return None

        recording = wait_until(whole_windows, DURATION, "whole windows on every GPU, both ways")
        exporter_source = open_source(url)
        exporter_frames = exporter_source.frames(None, None, WINDOW)
        last = recording.samples[-1].timestamp_seconds

        def scraped_up_to_last() -> bool | None:
            result = prometheus.api(
                "query",
                query="max_over_time(gpubalance_exporter_last_sample_timestamp_seconds[1m])",
            )["result"]
            return True if result and float(result[0]["value"][1]) >= last else None

        wait_until(scraped_up_to_last, 30, "Prometheus scraping the exporter's last sample")
    finally:
        lab.halt()
        thread.join(240)
    if failure:
        raise failure[0]
    target = f"127.0.0.1:{lab.exporter_port}"
    return Seen(recording, prometheus, exporter_source, exporter_frames, target)


@dataclass
class Look:
    """One look at both sides while the lab runs: each side's windows by GPU and index, the
    windows holding a sample no scrape saw, and the seconds they span."""

    snapshots: dict[tuple[str, int], GpuFrame]
    scraped: dict[tuple[str, int], GpuFrame]
    gaps: AbstractSet[int]
    seconds: float


def _standing(prometheus: Prometheus, look: Look) -> str:
    """Where a look's windows stand, per GPU: compared both ways, and what kept the others
    out (the snapshots' whole windows, Prometheus' whole ones, the windows holding a sample no
    scrape saw), with Prometheus' failed and slowest scrapes over the look's span."""
    compared = Counter(u for u, _ in _comparable(look.snapshots, look.scraped, look.gaps))
    whole = Counter(u for u, _ in _whole_after_whole(look.snapshots))
    full = Counter(u for (u, _), f in look.scraped.items() if _scraped_whole(f))
    span = f"[{math.ceil(look.seconds)}s]"
    scrapes = {
        name: prometheus.api("query", query=query)["result"]
        for name, query in (
            ("taken", f"count_over_time(up{span})"),
            ("failed", f"count_over_time(up{span}) - sum_over_time(up{span})"),
            ("slowest", f"max_over_time(scrape_duration_seconds{span})"),
        )
    }
    figures = {k: v[0]["value"][1] if v else "0" for k, v in scrapes.items()}
    return (
        f"compared both ways {dict(compared)}; of the windows, whole in the snapshots with the "
        f"one before {dict(whole)}, whole in Prometheus {dict(full)}, holding a sample no "
        f"scrape saw {len(look.gaps)} of {len({k for _, k in look.snapshots})}; Prometheus' "
        f"scrapes: {figures['failed']} of {figures['taken']} failed, the slowest "
        f"{figures['slowest']} s"
    )


def _known(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _band(value: Any, neighbours: list[Any], tolerance: tuple[float, float]) -> bool:
    """``value`` lies in the band of ``neighbours``, widened by the tolerance; unknown agrees
    with a band where some neighbour does not know either."""
    known = [v for v in neighbours if _known(v)]
    if not _known(value):
        return len(known) < len(neighbours)
    if not known:
        return False
    low, high = min(known), max(known)
    absolute, relative = tolerance
    slack = absolute + relative * max(abs(low), abs(high))
    return bool(low - slack <= value <= high + slack)


def _p95_agrees(p95: Any, mean: Any, neighbours: list[Any], tolerance: tuple[float, float]) -> bool:
    """Prometheus' percentile is one of 1 s means (the exporter's window gauge), the snapshots'
    one of NVML's 1/6 s samples: averaging narrows the spread, so it lies between the mean and
    the samples' percentile, not near the latter."""
    if not (_known(p95) and _known(mean)):
        return _band(p95, neighbours, tolerance)
    known = [v for v in neighbours if _known(v)]
    return bool(known) and mean - tolerance[0] <= p95 <= max(known) + tolerance[0]


def _agrees(
    name: str, value: Any, neighbours: list[Any], tolerance: tuple[float, float], mean: Any
) -> bool:
    if name == "utilization_p95_ratio":
        return _p95_agrees(value, mean, neighbours, tolerance)
    return _band(value, neighbours, tolerance)


def _sample_share(scraped: GpuFrame, snapshot: GpuFrame) -> float:
    """A Prometheus window's scrapes counted in the exporter's samples: its share of the
    scrapes it should hold, times the samples the snapshots' window should."""
    return scraped.sample_count * snapshot.expected_sample_count / scraped.expected_sample_count


def _slope_tolerance(
    base: tuple[float, float], queue_max: list[Any], seconds: float
) -> tuple[float, float]:
    """A slope's tolerance: the base plus what one sample can do (per ``seconds``), of the
    largest queue either side saw (the sample one window gains from the other's)."""
    largest = max((q for q in queue_max if _known(q)), default=0.0)
    return base[0] + SLOPE_PER_HEIGHT * seconds * largest, base[1]


Rows = dict[tuple[str, int], dict[str, float]]
Pools = dict[tuple[int, tuple[str, ...]], list[dict[str, float]]]


def _rows(table: FeatureTable) -> tuple[Rows, Pools]:
    """The rows by GPU and window, and by window and pool (its queues)."""
    rows: Rows = {}
    pools: Pools = {}
    for i, frame in enumerate(table.frames):
        k = round(frame.t_start / WINDOW)
        rows[(frame.uuid, k)] = table.row(i)
        pools.setdefault((k, frame.queue_names), []).append(rows[(frame.uuid, k)])
    return rows, pools


def _by_window(frames: list[GpuFrame]) -> dict[tuple[str, int], GpuFrame]:
    return {(f.uuid, round(f.t_start / WINDOW)): f for f in frames}


def _whole_after_whole(
    windows: dict[tuple[str, int], GpuFrame],
) -> set[tuple[str, int]]:
    """The windows holding every sample, whose window before holds every sample too."""
    whole = {key for key, f in windows.items() if f.sample_count == f.expected_sample_count}
    return {(uuid, k) for uuid, k in whole if (uuid, k - 1) in whole}


def _scraped_whole(frame: GpuFrame) -> bool:
    """A Prometheus window holding every scrape it should."""
    return frame.sample_count >= frame.expected_sample_count


def _comparable(
    snapshots: dict[tuple[str, int], GpuFrame],
    scraped: dict[tuple[str, int], GpuFrame],
    missed: AbstractSet[int],
) -> list[tuple[str, int]]:
    """The windows compared: whole in the snapshots with the one before them (the history
    starts inside its first window; Prometheus' lag reaches back into the one before), and
    holding every scrape in Prometheus (a missed scrape is a gap in its counters, not a
    difference between the two views), holding no exporter sample that no scrape saw."""
    return sorted(
        key
        for key in _whole_after_whole(snapshots)
        if key in scraped and _scraped_whole(scraped[key]) and key[1] not in missed
    )


def _neighbours(table: dict[tuple[str, int], T], uuid: str, k: int) -> list[T]:
    return [table[(uuid, j)] for j in (k - 1, k, k + 1) if (uuid, j) in table]


def _level(frames: list[GpuFrame], name: str) -> dict[str, float]:
    """Each GPU's mean of a figure over the run."""
    values: dict[str, list[float]] = {}
    for f in frames:
        if (value := getattr(f, name)) is not None:
            values.setdefault(f.uuid, []).append(value)
    return {uuid: float(np.mean(v)) for uuid, v in values.items()}


def test_snapshots_and_prometheus_agree_within_one_window(
    fakenvml_dir: Path, prometheus_for: Callable[[str], Prometheus], tmp_path: Path
) -> None:
    seen = run_seen_twice(fakenvml_dir, prometheus_for)
    recording = seen.recording
    last = recording.samples[-1].timestamp_seconds
    snapshot_frames = list(complete_windows(recording.frames(WINDOW), last))
    source = open_source(seen.prometheus.url)
    assert isinstance(source, PrometheusSource)
    prometheus_frames = source.frames(snapshot_frames[0].t_start, last, WINDOW)
    assert source.last_warnings == ()
    assert {f.host for f in prometheus_frames} == {seen.target}  # Prometheus' instance label
    samples_seen = scraped_samples(seen.prometheus, snapshot_frames[0].t_start, last)
    gaps = missed(recording, samples_seen)
    # the snapshots' windows one sample earlier: what Prometheus' windows hold when each
    # scrape comes just before the exporter's next sample
    earlier = dataclasses.replace(recording, origin=recording.origin - INTERVAL)
    lagging = earlier.frames(WINDOW)
    kept = tmp_path / "frames.json"  # every side, for a look when a figure differs
    kept.write_text(
        json.dumps(
            {
                "snapshots": [dataclasses.asdict(f) for f in snapshot_frames],
                "prometheus": [dataclasses.asdict(f) for f in prometheus_frames],
                "lagging": [dataclasses.asdict(f) for f in lagging],
                "missed": sorted(gaps),
            },
            default=sorted,
        )
    )
    assert_agreement(snapshot_frames, prometheus_frames, kept, gaps, lagging)
    # the exporter the lab ran was recognised as one while it ran; it leaves out the window
    # its history starts inside (the recording here, the looks' samples together, may start
    # inside another, and earlier)
    assert isinstance(seen.exporter_source, ExporterSource)
    after_first = sorted({f.t_start for f in snapshot_frames})[1]
    since = max(after_first, min(f.t_start for f in seen.exporter_frames))
    assert [f for f in seen.exporter_frames if since <= f.t_start and f.t_end <= last] == [
        f for f in snapshot_frames if since <= f.t_start
    ]


def _frame(saved: dict[str, Any]) -> GpuFrame:
    """A frame from ``frames.json`` (lists back to the tuples and sets they were; a field
    the frames were kept without, its default)."""
    hints = get_type_hints(GpuFrame)
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(GpuFrame):
        if field.name not in saved and field.default is not dataclasses.MISSING:
            continue
        value = saved[field.name]
        if isinstance(value, list) and "frozenset" in str(hints[field.name]):
            value = frozenset(value)
        elif isinstance(value, list):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        fields[field.name] = value
    return GpuFrame(**fields)


def _replayed(name: str) -> tuple[list[GpuFrame], list[GpuFrame], Path]:
    """A round's kept frames (``FIXTURES / name``): the snapshots', Prometheus', the path."""
    path = FIXTURES / name
    saved = json.loads(gzip.decompress(path.read_bytes()))
    return [_frame(f) for f in saved["snapshots"]], [_frame(f) for f in saved["prometheus"]], path


def test_the_start_up_windows_are_no_features_past() -> None:
    """The frames both ways of the round that failed (kept as the test keeps them): the run's
    second window's mean batch, 1.86 in the snapshots and 1.36 in Prometheus, was each
    source's largest batch, and every later batch fill differed by a third."""
    snapshots, scraped, path = _replayed("agreement-start-up.json.gz")
    assert max(f.batch_size_mean or 0 for f in snapshots if f.gpu == 1) == pytest.approx(
        1.86, abs=0.01
    )
    assert_agreement(snapshots, scraped, path)


def test_a_slope_may_move_by_one_sample_of_the_largest_queue_either_side_saw() -> None:
    """The frames of a round that failed (kept as the test keeps them): Prometheus' window
    held a queue of 2 from the last sample of the window before (the snapshots' maximum there),
    where the snapshots' own window reached 1. Its slope was -1.08 batches per window against
    0.16 and 0.41 either side: more than one sample of the snapshots' largest queue moves it,
    less than one of Prometheus' own."""
    snapshots, scraped, path = _replayed("agreement-slope-lag.json.gz")
    window = [f for f in scraped if f.gpu == 2 and round(f.t_start / WINDOW) == 179643032]
    assert [(f.queue_depth_max, round(f.queue_depth_slope_per_second, 3)) for f in window] == [
        (2.0, -0.121)
    ]
    assert_agreement(snapshots, scraped, path)


def assert_agreement(
    snapshot_frames: list[GpuFrame],
    prometheus_frames: list[GpuFrame],
    kept: Path,
    missed: AbstractSet[int] = frozenset(),
    lagging: list[GpuFrame] | None = None,
) -> None:
    """Frames, features and ranking agree within one window (``kept`` holds both sides):
    except in the windows whose scrapes ``missed`` a sample, each Prometheus frame lies in
    the band of the snapshots' frames of its window, the windows either side and the
    ``lagging`` one (its window's samples one sample earlier); the features likewise."""
    snapshots, scraped = _by_window(snapshot_frames), _by_window(prometheus_frames)
    assert {u for u, _ in scraped} == {u for u, _ in snapshots}, "the same GPUs"
    assert len({u for u, _ in scraped}) == 4
    compared = _comparable(snapshots, scraped, missed)
    lagged = _by_window(lagging or [])
    assert len(compared) >= 4 * 5, f"only {len(compared)} GPU windows seen whole both ways"

    mismatches: list[str] = []
    own_window: dict[str, list[bool]] = {}
    for uuid, k in compared:
        frame, neighbours = scraped[(uuid, k)], _neighbours(snapshots, uuid, k)
        if (uuid, k) in lagged:
            neighbours.append(lagged[(uuid, k)])
        for name, tolerance in FRAME_TOLERANCES.items():
            if name == "queue_depth_slope_per_second":
                queues = [frame.queue_depth_max, *(n.queue_depth_max for n in neighbours)]
                tolerance = _slope_tolerance(tolerance, queues, 1.0)
            mine, theirs = getattr(frame, name), [getattr(n, name) for n in neighbours]
            if name == "sample_count":
                mine = _sample_share(frame, snapshots[(uuid, k)])
            mean = frame.utilization_mean_ratio
            if not _agrees(name, mine, theirs, tolerance, mean):
                mismatches.append(f"{uuid} window {k} {name}: {mine} vs {theirs}")
            own = getattr(snapshots[(uuid, k)], name)
            own_window.setdefault(name, []).append(_agrees(name, mine, [own], tolerance, mean))
        for name in FRAME_EQUAL:
            mine, theirs = getattr(frame, name), [getattr(n, name) for n in neighbours]
            if mine not in theirs:
                mismatches.append(f"{uuid} window {k} {name}: {mine} vs {theirs}")
    assert not mismatches, f"frames differ (both in {kept}):\n" + "\n".join(mismatches)
    # a figure may match its neighbour's window, but most match their own: the windows line up
    for name, hits in own_window.items():
        assert sum(hits) >= len(hits) / 2, f"{name}: {sum(hits)} of {len(hits)} in their window"

    # the features, each source's frames with their own past from the end of the start-up:
    # a rate over the few samples of the window the history starts inside differs between the
    # sources, and the own best remembers it (the exporter's source drops that window too);
    # and the largest batch a GPU ran (the most of its windows' mean batch sizes, which batch
    # fill and effective utilization divide by) is set in the first whole windows, as the
    # workers take their first requests: in one of 13 rounds the run's second window had a
    # mean batch of 1.86 in the snapshots and 1.36 in Prometheus (within batch_size_mean's
    # tolerance), and every later fill differed by a third
    first = min(f.t_start for f in snapshot_frames if f.sample_count == f.expected_sample_count)
    first += START_UP_WINDOWS * WINDOW
    ours = FeatureBuilder().transform(f for f in prometheus_frames if f.t_start >= first)
    theirs = FeatureBuilder().transform(f for f in snapshot_frames if f.t_start >= first)
    our_rows, our_pools = _rows(ours)
    their_rows, their_pools = _rows(theirs)
    lagged_rows, _ = _rows(
        FeatureBuilder().transform(f for f in lagging or [] if f.t_start >= first - INTERVAL)
    )
    later = [(uuid, k) for uuid, k in compared if k * WINDOW >= first]
    assert len(later) >= 4 * 4, f"only {len(later)} GPU windows after the start-up, both ways"
    for uuid, k in later:
        row, neighbours = our_rows[(uuid, k)], _neighbours(their_rows, uuid, k)
        if (uuid, k) in lagged_rows:
            neighbours.append(lagged_rows[(uuid, k)])
        pool = scraped[(uuid, k)].queue_names
        for name in COLUMNS:
            if name in SNAPSHOT_ONLY:
                continue
            tolerance = FEATURE_TOLERANCES[name]
            if name == "queue_slope_batches_per_window":
                queues = [row["queue_max_batches"], *(n["queue_max_batches"] for n in neighbours)]
                tolerance = _slope_tolerance(tolerance, queues, WINDOW)
            if name in CUTS:
                cut = CUTS[name]
                # the queues the feature cuts: this row's, or its pool's, both ways
                rows = [row, *neighbours]
                if name == "pool_busy_share":
                    rows = our_pools[(k, pool)] + [
                        r for j in (k - 1, k, k + 1) for r in their_pools.get((j, pool), [])
                    ]
                slack = FEATURE_TOLERANCES[cut][0]
                if any(_known(r[cut]) and abs(r[cut] - QUEUED_BATCHES) <= slack for r in rows):
                    continue
            mine, values = row[name], [n[name] for n in neighbours]
            if name in FITS and not (_known(mine) and any(_known(v) for v in values)):
                continue
            if not _agrees(name, mine, values, tolerance, row["utilization_ratio"]):
                mismatches.append(f"{uuid} window {k} {name}: {mine} vs {values}")
    assert not mismatches, f"features differ (frames in {kept}):\n" + "\n".join(mismatches)

    # the ranking: which GPU queues most and which works most, over the windows both sides
    # have whole (the snapshots' first window, which the history starts inside, is a few
    # samples of start-up: with it, two like GPUs once differed by more than the margin on
    # one side only); GPUs whose levels differ by less than the margin may swap places
    both = [snapshots[key] for key in compared], [scraped[key] for key in compared]
    for name, margin in (("queue_depth_mean", 0.5), ("utilization_mean_ratio", 0.05)):
        snap, prom = _level(both[0], name), _level(both[1], name)
        assert max(snap, key=snap.__getitem__) == max(prom, key=prom.__getitem__), (name, snap)
        for a in snap:
            for b in snap:
                if snap[a] - snap[b] > margin:
                    assert prom[a] > prom[b], (name, a, b, snap, prom)
