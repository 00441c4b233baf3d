"""Where the analyzer's telemetry comes from: an exporter, a recorded lab run, or Prometheus.

Every source ends in the same frames (:mod:`gpubalance.analyzer.frames`). Windows are aligned
to multiples of the window length in Unix time for live sources (as a Prometheus range query's
steps are), and to the run's start for a lab recording (as its ground truth is).
"""

from __future__ import annotations

import csv
import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from gpubalance.analyzer.frames import GpuFrame, frames_from_lab_rows, frames_from_samples
from gpubalance.snapshot import Snapshot, from_json
from gpubalance.telemetry import Sample


class SourceError(Exception):
    """The source cannot be read; the message says which and why."""


@dataclass(frozen=True, slots=True)
class Recording:
    """Samples of one host in time order, with their sampling interval."""

    host: str
    interval_seconds: float
    samples: tuple[Sample, ...]
    origin: float  # where window 0 starts (Unix seconds)

    def frames(self, window_seconds: float) -> list[GpuFrame]:
        return list(
            frames_from_samples(
                self.samples,
                window_seconds=window_seconds,
                interval_seconds=self.interval_seconds,
                origin=self.origin,
            )
        )


def read_snapshots(path: Path) -> Recording:
    """A lab run's ``snapshots.jsonl``: one exporter snapshot per sample."""
    samples: list[Sample] = []
    interval: float | None = None
    with path.open("rb") as stream:
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                snapshot = from_json(line)
            except (ValidationError, ValueError) as exc:
                raise SourceError(f"{path}:{number}: not a gpubalance snapshot: {exc}") from None
            interval = snapshot.interval_seconds
            samples.append(snapshot.sample)
    if not samples or interval is None:
        raise SourceError(f"{path}: no snapshots")
    # the lab's first sample closes its first period: the run starts one interval before it
    origin = samples[0].timestamp_seconds - interval
    return Recording(samples[0].hostname, interval, tuple(samples), origin)


def lab_run_shortfall(directory: Path) -> str | None:
    """What a lab run directory's recording cannot show, or None when it has its snapshots:
    frames.csv (a run recorded with `--no-snapshots`, or before snapshots were the default)
    has no host or process series, no clock or power limits and no queue names."""
    if (directory / "snapshots.jsonl").is_file():
        return None
    return (
        f"{directory} has no snapshots.jsonl, only frames.csv, which has no host CPU, "
        "pressure or iowait, no process reads, no clock or power limits and no serving queue "
        "names: host_bound and io_bound go unseen, throttling shows by its reasons alone, and "
        "every GPU counts as one pool; `gpubalance lab run` records them (its default, "
        "--snapshots)"
    )


def lab_run_frames(directory: Path, window_seconds: float) -> list[GpuFrame]:
    """Frames of a lab run directory, from its snapshots when it has them, else frames.csv.

    Frames from snapshots carry Unix times; frames from the CSV carry seconds since the start.
    """
    snapshots = directory / "snapshots.jsonl"
    if snapshots.is_file():
        return read_snapshots(snapshots).frames(window_seconds)
    table = directory / "frames.csv"
    if not table.is_file():
        raise SourceError(
            f"{directory}: not a lab run directory (no snapshots.jsonl or frames.csv); "
            "make one with `gpubalance lab run SCENARIO --out DIR`"
        )
    with table.open(newline="") as stream:
        rows = csv.DictReader(stream)
        missing = {"t", "gpu", "uuid", "utilization"} - set(rows.fieldnames or ())
        if missing:
            raise SourceError(f"{table}: missing columns {', '.join(sorted(missing))}")
        try:
            return list(
                frames_from_lab_rows(rows, window_seconds=window_seconds, host=directory.name)
            )
        except (KeyError, ValueError) as exc:
            raise SourceError(f"{table}: line {rows.line_num}: cannot read: {exc}") from None


def fetch_snapshot(url: str, history: int, timeout: float = 5.0) -> Snapshot:
    """One ``/api/v1/snapshot?history=N`` from an exporter (``url`` is its base URL)."""
    target = f"{url.rstrip('/')}/api/v1/snapshot?history={history}"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        raise SourceError(f"{target}: HTTP {exc.code}: {exc.read()[:200]!r}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SourceError(f"{target}: cannot reach the exporter: {reason}") from None
    try:
        return from_json(body)
    except (ValidationError, ValueError, json.JSONDecodeError) as exc:
        raise SourceError(f"{target}: not a gpubalance snapshot: {exc}") from None


def exporter_recording(url: str, history: int, timeout: float = 5.0) -> Recording:
    """The exporter's last ``history`` samples and its latest one, windows on Unix time."""
    snapshot = fetch_snapshot(url, history, timeout)
    samples = (*snapshot.history, snapshot.sample)
    return Recording(snapshot.sample.hostname, snapshot.interval_seconds, samples, origin=0.0)


def complete_windows(frames: list[GpuFrame], now: float) -> Iterator[GpuFrame]:
    """The frames of windows that have ended by ``now`` (a live source's last one is open)."""
    return (f for f in frames if f.t_end <= now)


class FrameSource(Protocol):
    """Anything the analyzer reads frames from (see :func:`open_source`)."""

    @property
    def description(self) -> str: ...

    def frames(
        self,
        start: float | None,
        end: float | None,
        window_seconds: float,
        hosts: Sequence[str] | None = None,
    ) -> list[GpuFrame]:
        """Frames of the windows within ``[start, end]`` (None: as far as the source goes)."""
        ...


def _within(
    frames: Iterable[GpuFrame],
    start: float | None,
    end: float | None,
    hosts: Sequence[str] | None,
) -> list[GpuFrame]:
    return [
        f
        for f in frames
        if (start is None or f.t_start >= start)
        and (end is None or f.t_end <= end)
        and (hosts is None or f.host in hosts)
    ]


@dataclass(frozen=True, slots=True)
class ExporterSource:
    """One exporter's snapshot history: the windows its last samples cover, the open one left
    out."""

    url: str
    timeout: float = 5.0

    @property
    def description(self) -> str:
        return f"exporter at {self.url}"

    def frames(
        self,
        start: float | None,
        end: float | None,
        window_seconds: float,
        hosts: Sequence[str] | None = None,
    ) -> list[GpuFrame]:
        snapshot = fetch_snapshot(self.url, 0, self.timeout)
        # all the history it keeps: the exporter says how many samples that is
        history = int(snapshot.trend_window_seconds / snapshot.interval_seconds) + 1
        recording = exporter_recording(self.url, history, self.timeout)
        # the history starts inside a window and the newest sample's window has not ended:
        # both are incomplete by the source's doing, not the GPUs'
        first = recording.samples[0].timestamp_seconds - recording.interval_seconds
        last = recording.samples[-1].timestamp_seconds
        frames = [
            f
            for f in complete_windows(recording.frames(window_seconds), last)
            if f.t_start >= first
        ]
        return _within(frames, start, end, hosts)


@dataclass(frozen=True, slots=True)
class LabRunSource:
    """A recorded lab run directory (its snapshots, else its frames.csv)."""

    directory: Path

    @property
    def description(self) -> str:
        return f"lab run {self.directory}"

    def frames(
        self,
        start: float | None,
        end: float | None,
        window_seconds: float,
        hosts: Sequence[str] | None = None,
    ) -> list[GpuFrame]:
        return _within(lab_run_frames(self.directory, window_seconds), start, end, hosts)


def open_source(url_or_dir: str, timeout: float = 5.0) -> FrameSource:
    """What ``url_or_dir`` is: a Prometheus (or Thanos, Mimir) API, an exporter, or a lab run
    directory; a SourceError that says what each probe found when it is none of them."""
    if not url_or_dir.startswith(("http://", "https://")):
        path = Path(url_or_dir)
        if not path.is_dir():
            raise SourceError(
                f"{url_or_dir}: neither a URL (http://, https://) nor a lab run directory"
            )
        if not ((path / "snapshots.jsonl").is_file() or (path / "frames.csv").is_file()):
            raise SourceError(
                f"{path}: not a lab run directory (no snapshots.jsonl or frames.csv); "
                "make one with `gpubalance lab run SCENARIO --out DIR`"
            )
        return LabRunSource(path)
    # imported here: the Prometheus source raises this module's SourceError
    from gpubalance.analyzer.prometheus import PrometheusSource

    prometheus = PrometheusSource(url_or_dir, timeout=timeout)
    try:
        prometheus.probe()
        return prometheus
    except SourceError as exc:
        not_prometheus = str(exc)
    try:
        fetch_snapshot(url_or_dir, 0, timeout)
        return ExporterSource(url_or_dir, timeout)
    except SourceError as exc:
        not_exporter = str(exc)
    raise SourceError(
        f"{url_or_dir}: neither a Prometheus API nor a gpubalance exporter answers there "
        f"(as Prometheus: {not_prometheus}; as an exporter: {not_exporter})"
    )
