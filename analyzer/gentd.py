"""Real telemetry: the analyzer on Alibaba's GenTD26 diffusion-serving trace, checked.

GenTD26 (alibaba/clusterdata ``cluster-trace-v2026-GenAI``; Lin et al., SoCC 2025) holds, for
about 140 serving pods of one fleet over 22.8 hours, the GPU utilisation and GPU memory every
57 s, and, from the serving side, each pod's requests (``qps.csv``: one request per sample is a
value of 0.09) and queueing times (``queue_rt_raw_anon.csv``). No label says which pod was
starved or overloaded, so the verdicts are checked against the pods' own serving figures, which
the analyzer does not read: it sees what a GPU exporter gives (utilisation and memory), one
frame per pod and window, all pods peers of one pool.

- a **starved** pod should have had no request in the window while the fleet served some
  (*idle*);
- an **overloaded** pod should have had more requests than 90 % of the pods serving in that
  window, or a queueing time above the trace's 90th percentile (*hot*).

The trace is for research or study only: it is read where it lies (its archives, or their CSVs
extracted), never copied, and only aggregate figures leave this module.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpubalance.analyzer.features import FeatureBuilder
from gpubalance.analyzer.frames import GpuFrame
from gpubalance.analyzer.verdict import Classifier, Verdicts

STEP_SECONDS = 57.0  # the trace's sample period
WINDOW_SECONDS = 5 * STEP_SECONDS  # five samples a window: persistence spans ~10 minutes
REQUEST_QPS = 0.09  # a generative-requests value of one request in a sample
HOST = "gentd26"
FILES: Mapping[str, tuple[str, ...]] = {
    "pod_gpu_duty_cycle_anon": ("timestamp_anon", "value", "container_ip"),
    "pod_gpu_memory_used_bytes_anon": ("timestamp_anon", "value", "container_ip"),
    "qps": ("timestamp_anon", "value", "container_ip", "request_type"),
    "queue_rt_raw_anon": ("timestamp_anon", "value", "container_ip"),
}
GENERATIVE = "Generative Requests"
HOT_PERCENTILE = 90.0


class GentdError(Exception):
    """A folder or file that is not the GenTD26 trace; the message says what is wrong."""


def _rows(folder: Path, stem: str) -> Iterator[dict[str, str]]:
    """The rows of ``stem``.csv, from the folder or from its ``stem``.tar.gz."""
    columns = FILES[stem]
    plain, archive = folder / f"{stem}.csv", folder / f"{stem}.tar.gz"
    if plain.is_file():
        handle: io.TextIOBase = plain.open(newline="", encoding="utf-8")
    elif archive.is_file():
        try:
            with tarfile.open(archive) as tar:
                member = tar.extractfile(f"{stem}.csv")
                if member is None:
                    raise GentdError(f"{archive}: {stem}.csv in it is not a file")
                handle = io.StringIO(member.read().decode("utf-8"), newline="")
        except (tarfile.TarError, KeyError, OSError, UnicodeDecodeError) as exc:
            raise GentdError(f"{archive}: cannot read {stem}.csv from it ({exc})") from None
    else:
        raise GentdError(
            f"{folder}: no {stem}.csv or {stem}.tar.gz; expected the GenTD26 folder "
            "(alibaba/clusterdata cluster-trace-v2026-GenAI)"
        )
    with handle:
        reader = csv.DictReader(handle)
        missing = [c for c in columns if c not in (reader.fieldnames or ())]
        if missing:
            raise GentdError(f"{folder / stem}.csv: no column {', '.join(missing)}")
        for line, row in enumerate(reader, start=2):
            try:
                float(row["timestamp_anon"]), float(row["value"])
            except (TypeError, ValueError):
                raise GentdError(
                    f"{folder / stem}.csv:{line}: timestamp_anon and value must be numbers"
                ) from None
            yield row


@dataclass(frozen=True, slots=True)
class PodWindow:
    """A pod's own serving figures in one window: what the verdicts are checked against."""

    requests: int
    queue_ms: float | None  # mean queueing time of its samples in the window


@dataclass(frozen=True, slots=True)
class Trace:
    frames: tuple[GpuFrame, ...]
    serving: Mapping[tuple[int, float], PodWindow]  # (pod index, t_start)
    pods: int
    hours: float


def read(folder: Path, window_seconds: float = WINDOW_SECONDS) -> Trace:
    """Frames of every pod and window (utilisation, memory) and the pods' serving figures."""
    if not folder.is_dir():
        raise GentdError(f"{folder}: not a directory (the GenTD26 folder)")
    if not window_seconds >= STEP_SECONDS:
        raise GentdError(f"the window must hold a sample: at least {STEP_SECONDS:g} s")
    utilization: dict[str, list[tuple[float, float]]] = {}
    for row in _rows(folder, "pod_gpu_duty_cycle_anon"):
        utilization.setdefault(row["container_ip"], []).append(
            (float(row["timestamp_anon"]), float(row["value"]) / 100.0)
        )
    if not utilization:
        raise GentdError(f"{folder}: pod_gpu_duty_cycle_anon.csv has no rows")
    memory: dict[str, list[tuple[float, float]]] = {}
    for row in _rows(folder, "pod_gpu_memory_used_bytes_anon"):
        memory.setdefault(row["container_ip"], []).append(
            (float(row["timestamp_anon"]), float(row["value"]))
        )
    origin = min(t for samples in utilization.values() for t, _ in samples)
    end = max(t for samples in utilization.values() for t, _ in samples)

    def window_of(t: float) -> float:
        return origin + math.floor((t - origin) / window_seconds) * window_seconds

    requests: dict[tuple[str, float], int] = {}
    for row in _rows(folder, "qps"):
        if row["request_type"] == GENERATIVE and row["container_ip"]:
            key = (row["container_ip"], window_of(float(row["timestamp_anon"])))
            requests[key] = requests.get(key, 0) + round(float(row["value"]) / REQUEST_QPS)
    queue: dict[tuple[str, float], list[float]] = {}
    for row in _rows(folder, "queue_rt_raw_anon"):
        key = (row["container_ip"], window_of(float(row["timestamp_anon"])))
        queue.setdefault(key, []).append(float(row["value"]))

    expected = max(1, round(window_seconds / STEP_SECONDS))
    frames: list[GpuFrame] = []
    serving: dict[tuple[int, float], PodWindow] = {}
    for index, pod in enumerate(sorted(utilization)):
        by_window: dict[float, list[tuple[float, float]]] = {}
        for t, value in sorted(utilization[pod]):
            by_window.setdefault(window_of(t), []).append((t, value))
        used: dict[float, list[tuple[float, float]]] = {}
        for t, value in sorted(memory.get(pod, ())):
            used.setdefault(window_of(t), []).append((t, value))
        for t_start, samples in sorted(by_window.items()):
            frames.append(
                _frame(index, t_start, window_seconds, samples, used.get(t_start), expected)
            )
            waits = queue.get((pod, t_start))
            serving[(index, t_start)] = PodWindow(
                requests.get((pod, t_start), 0), statistics.fmean(waits) if waits else None
            )
    frames.sort(key=lambda f: (f.t_start, f.gpu))
    return Trace(tuple(frames), serving, len(utilization), (end - origin) / 3600.0)


def _frame(
    index: int,
    t_start: float,
    seconds: float,
    samples: list[tuple[float, float]],
    memory: list[tuple[float, float]] | None,
    expected: int,
) -> GpuFrame:
    values = [v for _, v in samples]
    slope = None
    if memory and len(memory) >= 2:
        times = np.array([t for t, _ in memory])
        if np.ptp(times) > 0:
            slope = float(np.polyfit(times, [v for _, v in memory], 1)[0])
    return GpuFrame(
        host=HOST,
        gpu=index,
        uuid=f"pod-{index}",
        card=None,  # the trace does not say
        t_start=t_start,
        t_end=t_start + seconds,
        sample_count=len(values),
        expected_sample_count=expected,
        lost=False,
        utilization_mean_ratio=statistics.fmean(values),
        utilization_p95_ratio=float(np.percentile(values, 95)),
        memory_used_bytes=int(memory[-1][1]) if memory else None,
        memory_total_bytes=None,
        memory_used_slope_bytes_per_second=slope,
        sm_clock_ratio=None,
        throttled_ratio=None,
        throttle_reasons=frozenset(),
        power_ratio=None,
        temperature_celsius=None,
        serving_queues=0,
        queue_depth_mean=None,
        queue_depth_max=None,
        queue_depth_slope_per_second=None,
        running_mean=None,
        batch_delay_seconds=None,
        request_duration_seconds=None,
        batch_size_mean=None,
        completions_per_second=None,
        allocation_failures=None,
        service_classes=(),
        queue_names=(),
        feeder_processes=0,
        feeder_cpu_cores_max=None,
        feeder_read_bytes_per_second=None,
        host_cpu_busy_ratio=None,
        host_cpu_pressure_ratio=None,
        host_io_pressure_ratio=None,
        host_iowait_ratio=None,
    )


def check(trace: Trace, classifiers: Mapping[str, Classifier]) -> dict[str, dict[str, object]]:
    """Per classifier: how its verdicts' states line up with the pods' own serving figures."""
    table = FeatureBuilder().transform(list(trace.frames))
    waits = [w.queue_ms for w in trace.serving.values() if w.queue_ms is not None]
    hot_queue_ms = float(np.percentile(waits, HOT_PERCENTILE)) if waits else math.inf
    by_window: dict[float, list[int]] = {}
    for (_, t_start), figures in trace.serving.items():
        by_window.setdefault(t_start, []).append(figures.requests)
    fleet_served = {t: sum(r) for t, r in by_window.items()}
    busy_bar = {
        t: float(np.percentile([x for x in r if x > 0], HOT_PERCENTILE)) if any(r) else math.inf
        for t, r in by_window.items()
    }

    def idle(key: tuple[int, float]) -> bool:
        return trace.serving[key].requests == 0 and fleet_served[key[1]] > 0

    def hot(key: tuple[int, float]) -> bool:
        figures = trace.serving[key]
        long_wait = figures.queue_ms is not None and figures.queue_ms > hot_queue_ms
        return (figures.requests > 0 and figures.requests >= busy_bar[key[1]]) or long_wait

    keys = list(trace.serving)
    idle_keys = {k for k in keys if idle(k)}
    hot_keys = {k for k in keys if hot(k)}
    out: dict[str, dict[str, object]] = {}
    for name, classifier in classifiers.items():
        diagnosis = Verdicts(classifier).diagnose(table)
        states = {
            (v.gpu, v.t_start): v.state
            for v in diagnosis.verdicts
            if (v.gpu, v.t_start) in trace.serving
        }
        per_state: dict[str, dict[str, float | int | None]] = {}
        for state in ("starved", "overloaded", "balanced", "unknown"):
            mine = [k for k, s in states.items() if s == state]
            counts = [trace.serving[k].requests for k in mine]
            waited = [trace.serving[k].queue_ms for k in mine]
            known_waits = [w for w in waited if w is not None]
            per_state[state] = {
                "windows": len(mine),
                "share": len(mine) / len(states) if states else 0.0,
                "requests_mean": statistics.fmean(counts) if counts else None,
                "no_request_share": (sum(1 for c in counts if c == 0) / len(counts))
                if counts
                else None,
                "queue_ms_median": statistics.median(known_waits) if known_waits else None,
            }
        starved = {k for k, s in states.items() if s == "starved"}
        overloaded = {k for k, s in states.items() if s == "overloaded"}
        out[name] = {
            "per_state": per_state,
            "starved_precision": _share(starved & idle_keys, starved),
            "starved_recall": _share(starved & idle_keys, idle_keys),
            # the contradiction: a pod called starved while among the busiest
            "starved_hot": _share(starved & hot_keys, starved),
            "overloaded_precision": _share(overloaded & hot_keys, overloaded),
            "overloaded_recall": _share(overloaded & hot_keys, hot_keys),
        }
    out["_trace"] = {
        "pods": trace.pods,
        "hours": trace.hours,
        "windows": len(keys),
        "idle_share": len(idle_keys) / len(keys) if keys else 0.0,
        "hot_share": len(hot_keys) / len(keys) if keys else 0.0,
        "hot_queue_ms": hot_queue_ms,
    }
    return out


def _share(part: set[tuple[int, float]], whole: set[tuple[int, float]]) -> float | None:
    return len(part) / len(whole) if whole else None


def _f(value: object, digits: int = 2) -> str:
    if value is None:
        return "-"
    assert isinstance(value, (int, float))
    return f"{value:.{digits}f}"


def report_markdown(figures: Mapping[str, Mapping[str, object]], command: str) -> str:
    """The GenTD26 section of EVALUATION.md: aggregate figures only, no row of the trace."""
    trace = figures["_trace"]
    judges = [name for name in figures if name != "_trace"]
    lines = [
        "## Real telemetry: Alibaba GenTD26",
        "",
        f"Written by `{command}`, GENTD_DIR being the folder of the 14 archives of",
        "alibaba/clusterdata `cluster-trace-v2026-GenAI` (research or study use only: read where",
        "it lies, never copied here). The analyzer reads each pod's GPU utilisation and memory",
        f"(57-s samples, {WINDOW_SECONDS:g}-s windows, all pods peers of one pool); the pods' own",
        "request counts and queueing times, which it does not read, check its verdicts.",
        f"{trace['pods']} pods, {_f(trace['hours'], 1)} hours, {trace['windows']:,} pod-windows;",
        f"*idle* (no request while the fleet served some): {_f(trace['idle_share'] * 100, 1)} %",
        f"of them; *hot* (requests in the window's top {100 - HOT_PERCENTILE:g} % of serving pods,",
        f"or queueing above {_f(trace['hot_queue_ms'], 0)} ms, the trace's p90):",
        f"{_f(trace['hot_share'] * 100, 1)} %.",
        "",
        "| classifier | starved: share of windows | starved that were idle | idle called starved "
        "| starved that were hot | overloaded: share | overloaded that were hot "
        "| hot called overloaded |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in judges:
        f = figures[name]
        states = f["per_state"]
        assert isinstance(states, Mapping)
        lines.append(
            f"| {name} | {_f(states['starved']['share'] * 100, 1)} % | "
            f"{_f(f['starved_precision'])} | {_f(f['starved_recall'])} | {_f(f['starved_hot'])} | "
            f"{_f(states['overloaded']['share'] * 100, 1)} % | {_f(f['overloaded_precision'])} | "
            f"{_f(f['overloaded_recall'])} |"
        )
    lines += [
        "",
        "Per verdict state: the pods' mean requests per window, the share of windows without",
        "a request, the median queueing time (windows with one).",
        "",
        "| classifier | state | windows | mean requests | no request | median queue (ms) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name in judges:
        states = figures[name]["per_state"]
        assert isinstance(states, Mapping)
        for state, s in states.items():
            if not s["windows"]:
                continue
            lines.append(
                f"| {name} | {state} | {s['windows']:,} | {_f(s['requests_mean'])} | "
                f"{_f(None if s['no_request_share'] is None else s['no_request_share'] * 100, 1)}"
                f" % | {_f(s['queue_ms_median'], 0)} |"
            )
    return "\n".join(lines) + "\n"
