"""Frames from the Prometheus HTTP API: a fleet of exporters in a few dozen range queries.

:class:`PrometheusSource` asks a Prometheus (or Thanos Query, or Mimir: standard
``/api/v1/query_range`` only, no admin API) for the exporter's native series, one query per
figure for every host at once, evaluated at window ends aligned to multiples of the window in
Unix time (what :func:`~gpubalance.analyzer.sources.exporter_recording` does with origin 0). Each
query's ``[W]`` range covers one window; the answers are joined by (host, ``gpu``, ``uuid``), and
serving queues and processes are mapped to their GPU by their labels, as the exporter does.

A frame from here means what a frame from the exporter's snapshots means, except where
Prometheus only has what the exporter exposes or what PromQL computes:

- Gauges are the exporter's last background sample as of each scrape: Prometheus' view lags the
  exporter's by up to one sampling interval, and scraping faster than the exporter samples
  repeats samples. ``sample_count`` counts scrapes of the GPU; ``expected_sample_count`` comes
  from ``scrape_interval_seconds`` when given, else from the ``up`` series (the median of the
  scrapes the windows of the asked range hold for the host, so pass the interval for short
  ranges).
- ``utilization_mean_ratio`` and ``throttled_ratio`` come from the exporter's window gauges
  (``gpubalance_gpu_utilization_ratio``, ``gpubalance_gpu_throttled_ratio``: figures over its
  ``--window``), as Prometheus has no NVML samples: their last value in the window when the
  exporter's window is at least the analysis window (exact when equal), else their mean, which
  then reaches back up to one exporter window before ``t_start``. The exporters' windows are
  asked first, and a figure no GPU takes is not asked (a fleet of like exporters saves two or
  three of the queries, each a series per GPU).
- ``utilization_p95_ratio`` is the 95th percentile of that gauge over the window, a percentile of
  per-exporter-window means (smoother than one of NVML's samples); None unless the exporter's
  window is at most a quarter of the analysis window, where it says something.
- ``throttle_reasons`` holds the reasons active at some scrape (one active only between scrapes
  is missed).
- Counters (``completions_per_second``, ``allocation_failures``, the token rates and the
  per-request means)
  come from ``increase()``: the window's own samples extrapolated to its edges, so counts can be
  fractional; a reset (a restarted worker) counts from zero. The snapshot path differences
  against the last sample before the window instead. The means (batch delay, request duration,
  batch size) are ratios of two increases, in which the extrapolation cancels; they are means
  over the events between the window's first and last scrape (those of the scrape interval
  before the first are in no window's mean).
- ``queue_depth_max`` sums each of the GPU's queues' maxima: equal to the maximum of their sum
  for one queue per GPU, an upper bound otherwise.
- ``kv_cache_usage_ratio`` is the largest of the GPU's queues' mean KV-cache usage over the
  window; the snapshot path takes the mean of the largest at each sample (equal for one queue
  per GPU; with several, the snapshot figure is at least as large).
- ``sm_clock_ratio`` is the mean SM clock over the last maximum clock, ``power_ratio`` the mean
  power over the mean limit: the snapshot path's mean ratios while the maximum and limit hold.
- ``host`` is the ``instance`` label (or ``host_label``), not the exporter's ``--hostname``.
- Prometheus 2 includes a sample exactly at ``t_start`` in the window (its ranges are closed);
  the snapshot path and Prometheus 3 leave it to the window before.

A ``NaN`` or infinite value (a NaN the exporter served, a division by zero) is None, as is a
series missing from a window. Warnings of the answers (Thanos and Mimir report partial
responses as warnings) are logged and kept in :attr:`PrometheusSource.last_warnings`.
"""

from __future__ import annotations

import dataclasses
import gzip
import logging
import math
import operator
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from gpubalance.analyzer.collection import collection_paused
from gpubalance.analyzer.frames import GpuFrame
from gpubalance.analyzer.sources import SourceError
from gpubalance.telemetry import SLOWDOWN_REASONS

log = logging.getLogger(__name__)

# Prometheus refuses a range query of more than 11,000 points per series (Thanos and Mimir
# keep the limit): longer ranges go in pieces.
MAX_STEPS = 10_000
# windows fetched when no start is given: as many as the features look back over
DEFAULT_WINDOWS = 20
# the utilization percentile needs this many exporter windows per analysis window
P95_MIN_EXPORTER_WINDOWS = 4


# one answer of a range query's pieces: its body, what was asked, its first step, its steps
_Piece = tuple[bytes, str, float, int]


@dataclass(frozen=True, slots=True)
class Matrix:
    """One range query's answer: each series' labels and its values at the query's steps."""

    labels: tuple[Mapping[str, str], ...]
    values: np.ndarray  # shape (series, steps); NaN where the series has no finite value


def _duration(seconds: float) -> str:
    milliseconds = round(seconds * 1000)
    if milliseconds <= 0:
        raise ValueError(f"a PromQL duration is at least 1 ms, got {seconds} s")
    return f"{milliseconds // 1000}s" if milliseconds % 1000 == 0 else f"{milliseconds}ms"


def _align(position: float, rounding: Callable[[float], int]) -> int:
    """A window boundary at or after (ceil) or before (floor) ``position`` (in windows); a
    position within 0.01 % of a window of a boundary is on it (float times drift)."""
    nearest = round(position)
    return nearest if abs(position - nearest) < 1e-4 else rounding(position)


def _promql_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# the CPU modes of the exporter's gpubalance_host_cpu_mode_seconds_total
CPU_MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
# the labels that tell a GPU's serving queues apart (besides the host and the GPU's)
QUEUE_LABELS = ("worker", "queue", "class", "source", "tenant")


def _queries(select: Callable[..., str], w: str, host: str) -> dict[str, str]:
    """Every figure of a frame, one PromQL expression each (``select`` writes a selector).

    Each keeps only the labels that join it (``max by``): a fleet's target labels (cluster,
    region, pod) would otherwise come back with each of its 10^5 series in every answer, and
    of two series of one exporter (two jobs scraping it) one is kept.
    """
    gpu = f"{host}, gpu, uuid"
    queue = ", ".join((gpu, *QUEUE_LABELS))

    def keep(labels: str, expression: str) -> str:
        return f"max by ({labels}) ({expression})"

    def reasons(reason: str) -> str:
        return select("gpubalance_gpu_throttle_reason", f"reason={_promql_string(reason)}")

    clock, max_clock = (
        select("gpubalance_gpu_clock_hertz", 'clock="sm"'),
        select("gpubalance_gpu_max_clock_hertz", 'clock="sm"'),
    )
    power, limit = select("gpubalance_gpu_power_watts"), select("gpubalance_gpu_power_limit_watts")
    utilization = select("gpubalance_gpu_utilization_ratio")
    throttled = select("gpubalance_gpu_throttled_ratio")
    memory = select("gpubalance_gpu_memory_used_bytes")
    lost = select("gpubalance_gpu_lost")
    depth = select("gpubalance_queue_depth")
    stalls = select(
        "gpubalance_host_pressure_waiting_seconds_total", 'kind="some"', 'resource=~"cpu|io"'
    )
    per_gpu = {
        "scrapes": f"count_over_time({lost}[{w}])",
        "lost": f"sum_over_time({lost}[{w}])",
        # 1 while a GPU's reads miss their deadline (one series per call it hangs in)
        "stale": f"sum_over_time({select('gpubalance_gpu_sample_stale')}[{w}])",
        "utilization": f"avg_over_time({utilization}[{w}])",
        "utilization_last": f"last_over_time({utilization}[{w}])",
        "utilization_p95": f"quantile_over_time(0.95, {utilization}[{w}])",
        "throttled": f"avg_over_time({throttled}[{w}])",
        "throttled_last": f"last_over_time({throttled}[{w}])",
        "memory_used": f"last_over_time({memory}[{w}])",
        "memory_total": f"last_over_time({select('gpubalance_gpu_memory_total_bytes')}[{w}])",
        "memory_slope": f"deriv({memory}[{w}])",
        "clock": f"avg_over_time({clock}[{w}]) / last_over_time({max_clock}[{w}])",
        "power": f"avg_over_time({power}[{w}]) / avg_over_time({limit}[{w}])",
        "temperature": f"avg_over_time({select('gpubalance_gpu_temperature_celsius')}[{w}])",
        # the largest batch limit of the GPU's queues (a gauge of each queue, max by GPU)
        "max_batch_size": f"max_over_time({select('gpubalance_batch_size_limit')}[{w}])",
    }
    per_queue = {
        "queue_depth": f"avg_over_time({depth}[{w}])",
        "queue_depth_max": f"max_over_time({depth}[{w}])",
        "queue_depth_slope": f"deriv({depth}[{w}])",
        "running": f"avg_over_time({select('gpubalance_batch_running_requests')}[{w}])",
        # a share of one queue's cache: the GPU's is its fullest queue's (not a sum)
        "kv_cache_usage": f"avg_over_time({select('gpubalance_kv_cache_usage_ratio')}[{w}])",
        "allocation_failures": (
            f"increase({select('gpubalance_memory_allocation_failures_total')}[{w}])"
        ),
        "prompt_tokens": f"increase({select('gpubalance_prompt_tokens_total')}[{w}])",
        "generation_tokens": f"increase({select('gpubalance_generation_tokens_total')}[{w}])",
    }
    for stem in ("batch_assembly_delay_seconds", "batch_size", "request_duration_seconds"):
        for part in ("sum", "count"):
            per_queue[f"{stem}_{part}"] = f"increase({select(f'gpubalance_{stem}_{part}')}[{w}])"
    return {
        "info": keep(f"{gpu}, name", f"last_over_time({select('gpubalance_gpu_info')}[{w}])"),
        # Prometheus evaluates a query on one core: the biggest selection (a series per
        # reason of every GPU) goes in one query per reason
        **{
            f"reasons_{reason}": keep(
                f"{gpu}, reason",
                f"max_over_time({reasons(reason)}[{w}])",
            )
            + " > 0"
            for reason in sorted(SLOWDOWN_REASONS)
        },
        **{name: keep(gpu, expression) for name, expression in per_gpu.items()},
        # hosts
        "exporter_window": keep(
            host, f"last_over_time({select('gpubalance_exporter_window_seconds')}[{w}])"
        ),
        "up": keep(host, f"count_over_time({select('up')}[{w}])"),
        # the host's CPU time summed over its CPUs by the exporter: 8 series a host, where the
        # per-CPU ones are 256 on a 32-CPU host (a third of a fleet's cost to Prometheus when
        # it summed them); an exporter without the sum leaves its host's CPU figures unknown
        "cpu": keep(
            f"{host}, mode",
            f"increase({select('gpubalance_host_cpu_mode_seconds_total')}[{w}])",
        ),
        "pressure": keep(f"{host}, resource", f"rate({stalls}[{w}])"),
        # processes holding a GPU
        "gpu_processes": keep(
            f"{gpu}, pid",
            f"count_over_time({select('gpubalance_gpu_process_memory_used_bytes')}[{w}])",
        ),
        "process_cpu": keep(
            f"{host}, pid", f"rate({select('gpubalance_process_cpu_seconds_total')}[{w}])"
        ),
        "process_read": keep(
            f"{host}, pid", f"rate({select('gpubalance_process_read_bytes_total')}[{w}])"
        ),
        # serving queues
        **{name: keep(queue, expression) for name, expression in per_queue.items()},
    }


SERVING_QUERIES = (
    "queue_depth",
    "queue_depth_max",
    "queue_depth_slope",
    "running",
    "kv_cache_usage",
    "allocation_failures",
    "prompt_tokens",
    "generation_tokens",
    *(
        f"{stem}_{part}"
        for stem in ("batch_assembly_delay_seconds", "batch_size", "request_duration_seconds")
        for part in ("sum", "count")
    ),
)


# serving figures that are a share of one queue's resource: a GPU's is its fullest queue's,
# as the snapshot source takes the largest of its queues' readings
MAX_ON_GPU = frozenset({"kv_cache_usage"})


def parse_matrix(body: Mapping[str, Any], first: float, step: float, steps: int) -> Matrix:
    """A ``query_range`` answer's series on the grid ``first + k·step``, ``k < steps``."""
    data = body.get("data")
    if not isinstance(data, Mapping) or data.get("resultType") != "matrix":
        kind = data.get("resultType") if isinstance(data, Mapping) else None
        raise SourceError(f"expected a matrix from query_range, got resultType {kind!r}")
    result = data.get("result") or []
    try:
        labels = tuple(series["metric"] for series in result)
        counts = [len(series["values"]) for series in result]
        points = [point for series in result for point in series["values"]]
        # one conversion for all points: a fleet's answer holds millions of them
        times = np.fromiter((p[0] for p in points), dtype=np.float64, count=len(points))
        values = np.array([p[1] for p in points], dtype=np.float64)
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise SourceError(f"not a Prometheus matrix: {exc!r}") from None
    matrix = np.full((len(result), steps), np.nan)
    columns = np.rint((times - first) / step).astype(np.int64)
    rows = np.repeat(np.arange(len(result)), counts)
    inside = (columns >= 0) & (columns < steps)
    matrix[rows[inside], columns[inside]] = values[inside]
    matrix[~np.isfinite(matrix)] = np.nan
    return Matrix(labels, matrix)


class PrometheusSource:
    """Frames of every GPU of every host an exporter reports to a Prometheus.

    ``url`` is the API's base (``http://prometheus:9090``, Mimir's
    ``http://mimir/prometheus``); ``selector`` adds label matchers to every query
    (``job="gpubalance"``); ``host_label`` names the label that tells hosts apart.
    ``headers`` go with every request (Mimir's ``X-Scope-OrgID``), and ``bearer_token`` as
    ``Authorization: Bearer``. ``partial_response`` is sent to Thanos when set.
    ``max_workers`` queries are in flight at once (Prometheus runs 20 by default).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        headers: Mapping[str, str] | None = None,
        bearer_token: str | None = None,
        selector: str = "",
        host_label: str = "instance",
        scrape_interval_seconds: float | None = None,
        partial_response: bool | None = None,
        max_workers: int = 16,
    ) -> None:
        self.url = url
        self.timeout = timeout
        self.headers = headers
        self.bearer_token = bearer_token
        self.selector = selector
        self.host_label = host_label
        self.scrape_interval_seconds = scrape_interval_seconds
        self.partial_response = partial_response
        self.max_workers = max_workers
        self.last_warnings: tuple[str, ...] = ()
        # seconds of the last frames() call: waiting on the queries, parsing, building frames
        self.last_timings: dict[str, float] = {}

    @property
    def description(self) -> str:
        return f"Prometheus API at {self.url}"

    # -- HTTP ------------------------------------------------------------------------------------

    def _request(self, path: str, form: Mapping[str, str] | None = None) -> dict[str, Any]:
        return _decode(*self._fetch(path, form))

    def _fetch(self, path: str, form: Mapping[str, str] | None = None) -> tuple[bytes, str]:
        """An answer's body, and what was asked (for messages)."""
        target = self.url.rstrip("/") + path
        headers = {"Accept": "application/json", "Accept-Encoding": "gzip"}
        if self.bearer_token:
            headers["Authorization"] = f"Bearer {self.bearer_token}"
        headers.update(self.headers or {})
        data = None
        if form is not None:
            data = urllib.parse.urlencode(form).encode()
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        request = urllib.request.Request(target, data=data, headers=headers)
        what = f"{target} ({form['query'][:120]})" if form and "query" in form else target
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
                encoding = response.headers.get("Content-Encoding")
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            if exc.headers.get("Content-Encoding") == "gzip":
                raw = gzip.decompress(raw)
            raise SourceError(f"{what}: HTTP {exc.code}: {_error_text(raw)}") from None
        except TimeoutError:
            raise SourceError(f"{what}: no answer within {self.timeout} s") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise SourceError(f"{target}: cannot reach Prometheus: {reason}") from None
        try:
            return (gzip.decompress(raw) if encoding == "gzip" else raw), what
        except OSError as exc:
            raise SourceError(f"{what}: not a Prometheus API answer: {exc}") from None

    def build_info(self) -> dict[str, Any]:
        """``/api/v1/status/buildinfo``: what answers (Prometheus, Thanos and Mimir have it)."""
        data = self._request("/api/v1/status/buildinfo").get("data")
        if not isinstance(data, dict):
            raise SourceError(f"{self.url}: buildinfo without data")
        return data

    def probe(self) -> str:
        """What answers at the URL, or a SourceError: its build info, else (an API without
        buildinfo) an instant query of ``1``, which every Prometheus-compatible API answers."""
        try:
            return f"Prometheus API {self.build_info().get('version', '')}".strip()
        except SourceError as exc:
            try:
                data = self._request("/api/v1/query", {"query": "1"}).get("data")
            except SourceError:
                raise exc from None
            if not isinstance(data, dict) or data.get("resultType") != "scalar":
                raise exc from None
            return "Prometheus-compatible API"

    def query_range(
        self, query: str, first_end: float, step: float, steps: int
    ) -> tuple[Matrix, list[str]]:
        """One range query evaluated at ``first_end + k·step``, in pieces Prometheus accepts."""
        return self._parse_range(query, step, self._fetch_range(query, first_end, step, steps))

    def _fetch_range(self, query: str, first_end: float, step: float, steps: int) -> list[_Piece]:
        """The answers to a range query's pieces: (body, what was asked, first step, steps)."""
        pieces = []
        for offset in range(0, steps, MAX_STEPS):
            count = min(MAX_STEPS, steps - offset)
            start = first_end + offset * step
            form = {
                "query": query,
                # milliseconds, as Prometheus keeps time: a float's last digits would truncate
                # to the millisecond before the window's end
                "start": f"{start:.3f}",
                "end": f"{start + (count - 1) * step:.3f}",
                "step": f"{step:.3f}",
                "timeout": _duration(self.timeout),
            }
            if self.partial_response is not None:
                form["partial_response"] = "true" if self.partial_response else "false"
            pieces.append((*self._fetch("/api/v1/query_range", form), start, count))
        return pieces

    def _parse_range(
        self, query: str, step: float, pieces: Sequence[_Piece]
    ) -> tuple[Matrix, list[str]]:
        parts: list[Matrix] = []
        warnings: list[str] = []
        for raw, what, start, count in pieces:
            body = _decode(raw, what)
            for key in ("warnings", "infos"):
                warnings.extend(str(w) for w in body.get(key) or ())
            try:
                parts.append(parse_matrix(body, start, step, count))
            except SourceError as exc:
                raise SourceError(f"{self.url} ({query[:120]}): {exc}") from None
        return _join_steps(parts), warnings

    # -- frames ----------------------------------------------------------------------------------

    def frames(
        self,
        start: float | None,
        end: float | None,
        window_seconds: float,
        hosts: Sequence[str] | None = None,
    ) -> list[GpuFrame]:
        """Frames of the windows ``[k·W, (k+1)·W)`` that lie within ``[start, end]``.

        ``end`` None is now; ``start`` None is :data:`DEFAULT_WINDOWS` windows before ``end``.
        ``hosts`` limits the answer to those values of the host label. In time order, then host
        and GPU; a GPU has a frame in each window where the exporter reported it.
        """
        if not window_seconds > 0:
            raise ValueError(f"window_seconds must be > 0, got {window_seconds}")
        w = window_seconds
        end = time.time() if end is None else end
        start = end - DEFAULT_WINDOWS * w if start is None else start
        first = _align(start / w, math.ceil)  # the first window's index
        steps = _align(end / w, math.floor) - first
        first_end = (first + 1) * w
        if steps <= 0 or (hosts is not None and not hosts):
            self.last_warnings, self.last_timings = (), {}
            return []
        matchers = [self.selector.strip()] if self.selector.strip() else []
        if hosts is not None:
            pattern = "|".join(re.escape(h) for h in hosts)
            matchers.append(f"{self.host_label}=~{_promql_string(pattern)}")

        def select(metric: str, *extra: str) -> str:
            inside = ",".join([*matchers, *extra])
            return metric + "{" + inside + "}" if inside else metric

        queries = _queries(select, _duration(w), self.host_label)
        with collection_paused():
            return self._frames(queries, first_end, w, steps)

    def _frames(
        self, queries: Mapping[str, str], first_end: float, w: float, steps: int
    ) -> list[GpuFrame]:
        began = time.perf_counter()
        parsing = 0.0
        answers: dict[str, tuple[Matrix, list[str]]] = {}
        with ThreadPoolExecutor(max_workers=self.max_workers) as pool:

            def send(names: Iterable[str]) -> dict[str, Future[list[_Piece]]]:
                return {
                    name: pool.submit(self._fetch_range, queries[name], first_end, w, steps)
                    for name in names
                }

            def take(name: str) -> Matrix:
                nonlocal parsing
                pieces = futures[name].result()
                parse_began = time.perf_counter()
                answers[name] = self._parse_range(queries[name], w, pieces)
                parsing += time.perf_counter() - parse_began
                return answers[name][0]

            futures = send(name for name in queries if name not in WINDOW_GAUGE_QUERIES)
            # every query runs to its end, and the error raised is that of the first query in
            # this order that failed: one fault, one message, whichever answer came first.
            # Answers are parsed here, one at a time while the others are on their way: the
            # threads only wait on the network, which they do without holding the GIL. The
            # GPUs and their exporters' windows come first: they say which of the window
            # gauges' figures some GPU needs, and only those are asked for
            needed = window_gauge_figures(take("info"), take("exporter_window"), self.host_label, w)
            futures.update(
                send(name for name, kind in WINDOW_GAUGE_QUERIES.items() if kind in needed)
            )
            for name in futures:
                if name not in answers:
                    take(name)
        fetched = time.perf_counter() - began
        warnings: list[str] = []
        for _, said in answers.values():
            for text in said:
                if text not in warnings:  # a store that is down warns in every answer
                    warnings.append(text)
        for warning in warnings:
            log.warning("%s: %s", self.url, warning)
        self.last_warnings = tuple(warnings)
        matrices = {name: matrix for name, (matrix, _) in answers.items()}
        began = time.perf_counter()
        frames = _Assembly(matrices, self.host_label, first_end, w, steps).frames(
            self.scrape_interval_seconds
        )
        self.last_timings = {
            "query": fetched - parsing,
            "parse": parsing,
            "frames": time.perf_counter() - began,
        }
        return frames


# the figures read from the exporter's window gauges, by which of them a frame takes: the
# gauge's last value in the window ("last": the exporter's window covers the analysis window),
# its mean ("mean": a shorter exporter window, or none known) and its 95th percentile ("p95":
# an exporter window of at most a quarter of the analysis window)
WINDOW_GAUGE_QUERIES = {
    "utilization": "mean",
    "utilization_last": "last",
    "utilization_p95": "p95",
    "throttled": "mean",
    "throttled_last": "last",
}


def window_gauge_figures(
    info: Matrix, exporter_window: Matrix, host_label: str, window_seconds: float
) -> set[str]:
    """Which figures of the window gauges (:data:`WINDOW_GAUGE_QUERIES`' kinds) some GPU's
    frame takes: a GPU's window takes its exporter's window of that step (its mean where
    none is known). Each kind is a query of every GPU: one no GPU takes is not sent, which on
    a fleet of like exporters saves two or three of them."""
    if not info.labels:
        return set()
    hosts: dict[str, np.ndarray] = {}  # host -> the steps in which it reports a GPU
    for labels, values in zip(info.labels, info.values, strict=True):
        host = labels.get(host_label, "")
        seen = ~np.isnan(values)
        hosts[host] = hosts[host] | seen if host in hosts else seen
    windows = {
        labels.get(host_label, ""): values
        for labels, values in zip(exporter_window.labels, exporter_window.values, strict=True)
    }
    kinds: set[str] = set()
    for host, reporting in hosts.items():
        known = windows.get(host)
        exporter = known[reporting] if known is not None else np.full(reporting.sum(), np.nan)
        whole = exporter >= window_seconds * (1 - 1e-6)  # NaN: not whole
        if whole.any():
            kinds.add("last")
        if not whole.all():
            kinds.add("mean")
        if (exporter * P95_MIN_EXPORTER_WINDOWS <= window_seconds * (1 + 1e-6)).any():
            kinds.add("p95")
    return kinds


def _decode(raw: bytes, what: str) -> dict[str, Any]:
    """A successful answer's JSON body (orjson: a fleet's answers are tens of megabytes)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SourceError(f"{what}: not a Prometheus API answer: {exc}") from None
    if not isinstance(body, dict) or body.get("status") != "success":
        raise SourceError(f"{what}: {_error_text(raw)}")
    return body


def _error_text(raw: bytes) -> str:
    """Prometheus' own words for a failed request (its JSON error, else the body's start)."""
    try:
        body = orjson.loads(raw)
    except ValueError:
        return raw[:200].decode(errors="replace").strip() or "empty answer"
    if isinstance(body, dict) and "error" in body:
        return f"{body.get('errorType', 'error')}: {body['error']}"
    return raw[:200].decode(errors="replace")


def _key(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def _join_steps(parts: Sequence[Matrix]) -> Matrix:
    if len(parts) == 1:
        return parts[0]
    rows: dict[tuple[tuple[str, str], ...], int] = {}
    for part in parts:
        for labels in part.labels:
            rows.setdefault(_key(labels), len(rows))
    widths = [p.values.shape[1] for p in parts]
    values = np.full((len(rows), sum(widths)), np.nan)
    column = 0
    labels_of: dict[int, Mapping[str, str]] = {}
    for part, width in zip(parts, widths, strict=True):
        for i, labels in enumerate(part.labels):
            row = rows[_key(labels)]
            labels_of[row] = labels
            values[row, column : column + width] = part.values[i]
        column += width
    return Matrix(tuple(labels_of[i] for i in range(len(rows))), values)


# a GPU's serving queues in a window: how many, their service classes, their names
_QueueLabels = tuple[int, tuple[str, ...], tuple[str, ...], tuple[str, ...]]


class _Assembly:
    """The answers of one ``frames`` call joined into arrays of (GPU, window)."""

    def __init__(
        self,
        matrices: Mapping[str, Matrix],
        host_label: str,
        first_end: float,
        window: float,
        steps: int,
    ) -> None:
        self.m = matrices
        self.host_label = host_label
        self.first_end, self.window, self.steps = first_end, window, steps
        info = matrices["info"]
        gpus: dict[tuple[str, str, str], Mapping[str, str]] = {}
        for labels in info.labels:
            gpus.setdefault(self._gpu_key(labels), labels)
        self.gpu_keys = sorted(gpus, key=lambda k: (k[0], _index(k[1]), k[2]))
        self.gpu_labels = [gpus[k] for k in self.gpu_keys]
        self.gpu_row = {key: row for row, key in enumerate(self.gpu_keys)}
        self.by_uuid = {(h, u): row for row, (h, _, u) in enumerate(self.gpu_keys) if u}
        self.by_index = {(h, g): row for row, (h, g, _) in enumerate(self.gpu_keys)}
        self.hosts = sorted({h for h, _, _ in self.gpu_keys})
        self.host_row = {host: row for row, host in enumerate(self.hosts)}
        self.host_of_gpu = np.array([self.host_row[h] for h, _, _ in self.gpu_keys], dtype=int)
        # per query: its series' host rows, and the values of a label of its series
        self._host_rows: dict[str, np.ndarray] = {}
        self._labels: dict[tuple[str, str], np.ndarray] = {}

    def _gpu_key(self, labels: Mapping[str, str]) -> tuple[str, str, str]:
        return labels.get(self.host_label, ""), labels.get("gpu", ""), labels.get("uuid", "")

    def _gpu_rows(self, labels: Sequence[Mapping[str, str]]) -> list[int]:
        """Each series' GPU row (-1: none): ``_gpu_key`` inlined, 10^5 series a fleet; the
        labels taken at once where every series has all three (an answer's usual case)."""
        row, host = self.gpu_row.get, self.host_label
        try:
            key = operator.itemgetter(host, "gpu", "uuid")
            return [row(key(s), -1) for s in labels]
        except KeyError:
            return [row((s.get(host, ""), s.get("gpu", ""), s.get("uuid", "")), -1) for s in labels]

    def _empty(self, rows: int) -> np.ndarray:
        return np.full((rows, self.steps), np.nan)

    @staticmethod
    def _place(out: np.ndarray, rows: Sequence[int] | np.ndarray, values: np.ndarray) -> np.ndarray:
        """``values``' series into ``out``'s ``rows`` (-1: nowhere); of two series for one row
        (two jobs scraping one exporter), the later."""
        where = np.asarray(rows, dtype=np.int64)
        mine = where >= 0
        out[where[mine]] = values[mine]
        return out

    def gpu(self, name: str) -> np.ndarray:
        """A per-GPU query on the GPU rows; unknown where it was not asked (a window gauge's
        figure no GPU takes)."""
        matrix = self.m.get(name)
        if matrix is None:
            return self._empty(len(self.gpu_keys))
        return self._place(
            self._empty(len(self.gpu_keys)), self._gpu_rows(matrix.labels), matrix.values
        )

    def host(self, name: str, **where: str) -> np.ndarray:
        """A per-host query (the series whose labels hold ``where``) on the GPU rows."""
        matrix = self.m[name]
        rows = self._host_rows.get(name)
        if rows is None:  # once per query: a host's CPU modes are eight calls on one answer
            host, row = self.host_label, self.host_row.get
            rows = np.array([row(labels.get(host, ""), -1) for labels in matrix.labels], np.int64)
            self._host_rows[name] = rows
        for label, value in where.items():
            rows = np.where(self._label_values(name, label) == value, rows, -1)
        return self._place(self._empty(len(self.hosts)), rows, matrix.values)[self.host_of_gpu]

    def _label_values(self, name: str, label: str) -> np.ndarray:
        """One label of each series of a query's answer (None where it has none)."""
        key = (name, label)
        if key not in self._labels:
            self._labels[key] = np.array([s.get(label) for s in self.m[name].labels], object)
        return self._labels[key]

    def _gpu_of(self, labels: Mapping[str, str]) -> int | None:
        """The GPU a serving queue or process is on: by UUID when it has one, else by index."""
        host = labels.get(self.host_label, "")
        uuid = labels.get("uuid", "")
        if uuid:
            return self.by_uuid.get((host, uuid))
        gpu = labels.get("gpu", "")
        return self.by_index.get((host, gpu)) if gpu else None

    def _serving(self) -> tuple[list[tuple[int, Mapping[str, str]]], dict[str, np.ndarray]]:
        """The serving series on a GPU, and each serving query on those series' rows."""
        # a series' identity: the serving queries keep only these labels (``max by``)
        names = (self.host_label, "gpu", "uuid", *QUEUE_LABELS)
        keys = {
            name: [tuple(map(labels.get, names)) for labels in self.m[name].labels]
            for name in SERVING_QUERIES
        }
        rows: dict[tuple[str | None, ...], int] = {}
        series: list[tuple[int, Mapping[str, str]]] = []
        for name in SERVING_QUERIES:
            for key, labels in zip(keys[name], self.m[name].labels, strict=True):
                if key in rows:
                    continue
                gpu = self._gpu_of(labels)
                if gpu is not None:
                    rows[key] = len(series)
                    series.append((gpu, labels))
        values = {
            name: self._place(
                self._empty(len(series)),
                [rows.get(key, -1) for key in keys[name]],
                self.m[name].values,
            )
            for name in SERVING_QUERIES
        }
        return series, values

    def _sum_on_gpus(self, gpu_of: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Per GPU and window, the sum over its series that have a value (NaN when none has)."""
        total = np.zeros((len(self.gpu_keys), self.steps))
        seen = np.zeros((len(self.gpu_keys), self.steps), dtype=bool)
        present = ~np.isnan(values)
        np.add.at(total, gpu_of, np.where(present, values, 0.0))
        np.logical_or.at(seen, gpu_of, present)
        total[~seen] = np.nan
        return total

    def _max_on_gpus(self, gpu_of: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Per GPU and window, the largest of its series' values (NaN when none has one)."""
        out = np.full((len(self.gpu_keys), self.steps), -np.inf)
        np.maximum.at(out, gpu_of, np.where(np.isnan(values), -np.inf, values))
        out[np.isneginf(out)] = np.nan
        return out

    def _by_pid(self, name: str, pids: list[tuple[str, str]]) -> np.ndarray:
        """A per-process query on the rows of ``pids`` (host, pid)."""
        matrix = self.m[name]
        row_of = {
            (labels.get(self.host_label, ""), labels.get("pid", "")): i
            for i, labels in enumerate(matrix.labels)
        }
        rows = [row_of.get(pid, -1) for pid in pids]
        out = self._empty(len(pids))
        where = np.array(rows, dtype=np.int64)
        mine = where >= 0
        out[mine] = matrix.values[where[mine]]
        return out

    def _feed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Processes per GPU, the busiest one's cores, and their summed read rate."""
        listed = self.m["gpu_processes"]
        gpus = [self._gpu_of(labels) for labels in listed.labels]
        mine = [i for i, gpu in enumerate(gpus) if gpu is not None]
        gpu_of = np.array([gpus[i] for i in mine], dtype=np.int64)
        pids = [
            (listed.labels[i].get(self.host_label, ""), listed.labels[i].get("pid", ""))
            for i in mine
        ]
        on = ~np.isnan(listed.values[mine]) if mine else np.zeros((0, self.steps), dtype=bool)
        count = np.zeros((len(self.gpu_keys), self.steps))
        np.add.at(count, gpu_of, on)
        cores = self._empty(len(self.gpu_keys))
        np.fmax.at(cores, gpu_of, np.where(on, self._by_pid("process_cpu", pids), np.nan))
        reads = self._sum_on_gpus(gpu_of, np.where(on, self._by_pid("process_read", pids), np.nan))
        return count, cores, reads

    def _gpu_figures(self) -> dict[str, np.ndarray]:
        """The GPUs' own figures, by GpuFrame field."""
        w = self.window
        exporter_window = self.host("exporter_window")
        whole = exporter_window >= w * (1 - 1e-6)  # the gauge covers the analysis window
        utilization = np.where(whole, self.gpu("utilization_last"), self.gpu("utilization"))
        # a percentile where the mean is unknown (a NaN reading) would be a guess
        p95 = np.where(
            (exporter_window * P95_MIN_EXPORTER_WINDOWS <= w * (1 + 1e-6)) & ~np.isnan(utilization),
            self.gpu("utilization_p95"),
            np.nan,
        )
        return {
            "utilization_mean_ratio": utilization,
            "utilization_p95_ratio": p95,
            "memory_used_slope_bytes_per_second": self.gpu("memory_slope"),
            "sm_clock_ratio": self.gpu("clock"),
            "throttled_ratio": np.where(whole, self.gpu("throttled_last"), self.gpu("throttled")),
            "power_ratio": self.gpu("power"),
            "temperature_celsius": self.gpu("temperature"),
            "max_batch_size": self.gpu("max_batch_size"),
        }

    def _host_figures(self) -> dict[str, np.ndarray]:
        """The hosts' figures on their GPUs' rows, by GpuFrame field."""
        cpu_total = sum(
            (
                np.nan_to_num(self.host("cpu", mode=mode))
                for mode in CPU_MODES
                if mode not in ("idle", "iowait")
            ),
            start=np.zeros((len(self.gpu_keys), self.steps)),
        )
        idle, iowait = self.host("cpu", mode="idle"), self.host("cpu", mode="iowait")
        cpu_total = cpu_total + idle + iowait  # NaN without the idle and iowait series
        with np.errstate(invalid="ignore", divide="ignore"):
            busy = np.where(cpu_total > 0, (cpu_total - idle - iowait) / cpu_total, np.nan)
            iowait_ratio = np.where(cpu_total > 0, iowait / cpu_total, np.nan)
        return {
            "host_cpu_busy_ratio": busy,
            "host_cpu_pressure_ratio": np.minimum(1.0, self.host("pressure", resource="cpu")),
            "host_io_pressure_ratio": np.minimum(1.0, self.host("pressure", resource="io")),
            "host_iowait_ratio": iowait_ratio,
        }

    def _serving_figures(self) -> tuple[dict[str, np.ndarray], dict[str, list[list[Any]]]]:
        """The serving figures of each GPU's queues, summed, and the queues' labels (how
        many, their service classes, their names), by GpuFrame field."""
        series, serving = self._serving()
        gpu_of = np.array([g for g, _ in series], dtype=int)
        on_gpu = {
            name: (self._max_on_gpus if name in MAX_ON_GPU else self._sum_on_gpus)(gpu_of, values)
            for name, values in serving.items()
        }
        with np.errstate(invalid="ignore", divide="ignore"):

            def mean_of(stem: str) -> np.ndarray:
                counts = on_gpu[f"{stem}_count"]
                return np.where(counts > 0, on_gpu[f"{stem}_sum"] / counts, np.nan)

            figures = {
                "queue_depth_mean": on_gpu["queue_depth"],
                "queue_depth_max": on_gpu["queue_depth_max"],
                "queue_depth_slope_per_second": on_gpu["queue_depth_slope"],
                "running_mean": on_gpu["running"],
                "kv_cache_usage_ratio": on_gpu["kv_cache_usage"],
                "batch_delay_seconds": mean_of("batch_assembly_delay_seconds"),
                "request_duration_seconds": mean_of("request_duration_seconds"),
                "batch_size_mean": mean_of("batch_size"),
                "completions_per_second": on_gpu["request_duration_seconds_count"] / self.window,
                "allocation_failures": on_gpu["allocation_failures"],
                "prompt_tokens_per_second": on_gpu["prompt_tokens"] / self.window,
                "generation_tokens_per_second": on_gpu["generation_tokens"] / self.window,
            }
        listed = np.zeros((len(series), self.steps), dtype=bool)
        for values in serving.values():
            listed |= ~np.isnan(values)
        # a queue listed that held nothing waiting and completed nothing (where it counts
        # completions): a server lists a class's queue whether or not the class came, and
        # its class is not one the GPU served
        idle = (serving["request_duration_seconds_count"] == 0) & (serving["queue_depth_max"] == 0)
        # per queue and window: 0 not listed, 1 listed, 2 listed and idle
        listed_l = (listed.astype(np.int8) + (listed & idle)).tolist()
        queues_of: dict[int, list[int]] = {}
        for i, (gpu, _) in enumerate(series):
            queues_of.setdefault(gpu, []).append(i)
        # the labels of each set of queues a GPU had listed, computed once per set
        labels_of: dict[tuple[int | bool, ...], _QueueLabels] = {}
        queues, classes, names, workers = [], [], [], []
        for g in range(len(self.gpu_keys)):
            mine = queues_of.get(g, [])
            per_step = []
            for k in range(self.steps):
                key = (g, *(listed_l[i][k] for i in mine))
                if key not in labels_of:
                    on = [series[i][1] for i, now in zip(mine, key[1:], strict=True) if now]
                    came = [series[i][1] for i, now in zip(mine, key[1:], strict=True) if now == 1]
                    labels_of[key] = (
                        len({(q.get("worker"), q.get("source"), q.get("queue")) for q in on}),
                        tuple(sorted({c for q in came if (c := q.get("class", ""))})),
                        tuple(sorted({q.get("queue", "") for q in on})),
                        tuple(sorted({w for q in on if (w := q.get("worker", ""))})),
                    )
                per_step.append(labels_of[key])
            queues.append([q for q, _, _, _ in per_step])
            classes.append([c for _, c, _, _ in per_step])
            names.append([q for _, _, q, _ in per_step])
            workers.append([w for _, _, _, w in per_step])
        return figures, {
            "serving_queues": queues,
            "service_classes": classes,
            "queue_names": names,
            "workers": workers,
        }

    def _reasons(self) -> list[list[frozenset[str]]]:
        """Per GPU and window, the slowdown reasons active at some scrape."""
        active: dict[int, list[tuple[str, np.ndarray]]] = {}
        for reason in sorted(SLOWDOWN_REASONS):
            matrix = self.m[f"reasons_{reason}"]
            for labels, values in zip(matrix.labels, matrix.values, strict=True):
                row = self.gpu_row.get(self._gpu_key(labels))
                if row is not None:
                    active.setdefault(row, []).append((labels.get("reason", ""), ~np.isnan(values)))
        none: frozenset[str] = frozenset()
        return [
            [frozenset(r for r, on in active[g] if on[k]) for k in range(self.steps)]
            if g in active
            else [none] * self.steps
            for g in range(len(self.gpu_keys))
        ]

    def frames(self, scrape_interval: float | None) -> list[GpuFrame]:
        if not self.gpu_keys:
            return []
        w, n, gpus = self.window, self.steps, len(self.gpu_keys)
        scrapes = np.nan_to_num(self.gpu("scrapes"))
        lost = np.nan_to_num(self.gpu("lost"))
        stale = np.minimum(np.nan_to_num(self.gpu("stale")), scrapes - lost)
        if scrape_interval is not None:
            expected = np.full(gpus, max(1, round(w / scrape_interval)))
        else:
            # the scrapes attempted in a window, failed ones included: the median over the
            # windows the host was scraped in. Not the most: a scrape that starts late on a
            # busy Prometheus puts one more in a window than its interval does, and every
            # other window would then read as one short
            attempted = np.fmax(self.host("up"), scrapes)
            attempted[~(attempted > 0)] = np.nan
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # a GPU never scraped: NaN
                typical = np.nanmedian(attempted, axis=1)
            expected = np.maximum(1, np.round(np.nan_to_num(typical))).astype(int)
        serving, queue_labels = self._serving_figures()
        processes, cores, reads = self._feed()
        figures = {
            **self._gpu_figures(),
            **serving,
            "feeder_cpu_cores_max": cores,
            "feeder_read_bytes_per_second": reads,
            **self._host_figures(),
        }
        # every field as one list of Python objects (None where NaN) over (GPU, window) in
        # GPU-major order, made once for all frames: a fleet has 10^5 frames, each one zip of
        # these
        fields: dict[str, list[Any]] = {
            name: _objects(values).ravel().tolist() for name, values in figures.items()
        }
        t_ends = [self.first_end + k * w for k in range(n)]

        def each_window(per_gpu: Sequence[Any]) -> list[Any]:
            return [value for value in per_gpu for _ in range(n)]

        def flat(per_step: Sequence[Sequence[Any]]) -> list[Any]:
            return [value for row in per_step for value in row]

        fields.update(
            {name: flat(values) for name, values in queue_labels.items()},
            host=each_window([h for h, _, _ in self.gpu_keys]),
            gpu=each_window([_index(i) for _, i, _ in self.gpu_keys]),
            uuid=each_window([u for _, _, u in self.gpu_keys]),
            card=each_window([labels.get("name") or None for labels in self.gpu_labels]),
            t_start=[t - w for t in t_ends] * gpus,
            t_end=t_ends * gpus,
            # fresh readings, as the snapshot path counts them: neither lost nor stale
            sample_count=(scrapes - lost - stale).astype(int).ravel().tolist(),
            stale_sample_count=stale.astype(int).ravel().tolist(),
            # which call a stale GPU hangs in is a label of its stale series; not joined here
            stale_call=[None] * (gpus * n),
            # per-class request durations are not among the series queried
            class_duration_ratio=[None] * (gpus * n),
            slow_class_work_share=[None] * (gpus * n),
            expected_sample_count=each_window([int(e) for e in expected]),
            lost=(lost > 0).ravel().tolist(),
            memory_used_bytes=_objects(self.gpu("memory_used"), int).ravel().tolist(),
            memory_total_bytes=_objects(self.gpu("memory_total"), int).ravel().tolist(),
            throttle_reasons=flat(self._reasons()),
            feeder_processes=processes.astype(int).ravel().tolist(),
        )
        order = [f.name for f in dataclasses.fields(GpuFrame)]
        present = (~np.isnan(self.gpu("info"))).ravel().tolist()
        columns = zip(*(fields[name] for name in order), strict=True)
        made = [
            GpuFrame(*args) if here else None for here, args in zip(present, columns, strict=True)
        ]
        # in time order, then host and GPU: window k of GPU g is at g·n + k
        return [f for k in range(n) for g in range(gpus) if (f := made[g * n + k]) is not None]


def _objects(values: np.ndarray, kind: type = float) -> np.ndarray:
    """``values`` as Python numbers of ``kind``, None where NaN (the plain types' unknown)."""
    out = np.full(values.shape, None, dtype=object)
    known = ~np.isnan(values)
    out[known] = values[known].astype(np.int64 if kind is int else np.float64)
    return out


def _index(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return -1
