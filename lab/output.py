"""What `gpubalance lab run` writes: frames.csv, truth.csv (+ truth_evidence.csv), requests.csv
and, when asked, snapshots.jsonl in the exporter's /api/v1/snapshot schema.

Numbers are written with fixed rules (integers as integers, floats rounded to 6 decimals), so
the same scenario and seed give byte-identical files.
"""

from __future__ import annotations

import csv
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from gpubalance.exporter.window import compute_window
from gpubalance.lab.truth import TruthRow
from gpubalance.lab.workload import RequestRecord
from gpubalance.snapshot import SCHEMA, Snapshot, to_json
from gpubalance.telemetry import Sample

TRUTH_COLUMNS = ("t_start", "t_end", "gpu", "state", "cause")
REQUEST_COLUMNS = (
    "id",
    "arrival",
    "start",
    "end",
    "gpu",
    "worker",
    "class",
    "tenant",
    "outcome",
    "batch_size",
)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        text = f"{value:.6f}".rstrip("0").rstrip(".")
        return "0" if text in ("-0", "") else text
    return str(value)


def _write(path: Path, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow([_cell(v) for v in row])


def write_frames(path: Path, frames: Sequence[Mapping[str, object]]) -> None:
    columns = list(frames[0]) if frames else ["t", "gpu"]
    _write(path, columns, ([frame[c] for c in columns] for frame in frames))


def write_truth(directory: Path, rows: Sequence[TruthRow]) -> None:
    _write(
        directory / "truth.csv",
        TRUTH_COLUMNS,
        ((r.t_start, r.t_end, r.gpu, r.state, r.cause) for r in rows),
    )
    evidence = list(asdict(rows[0])) if rows else list(TRUTH_COLUMNS)
    _write(
        directory / "truth_evidence.csv", evidence, ([asdict(r)[c] for c in evidence] for r in rows)
    )


def write_requests(path: Path, records: Sequence[RequestRecord]) -> None:
    _write(
        path,
        REQUEST_COLUMNS,
        (
            (
                r.id,
                r.arrival_seconds,
                r.start_seconds,
                r.end_seconds,
                r.gpu,
                r.worker,
                r.service_class,
                r.tenant,
                r.outcome,
                r.batch_size,
            )
            for r in records
        ),
    )


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


class SnapshotWriter:
    """Appends one /api/v1/snapshot document per sample, with its window figures."""

    def __init__(self, stream: IO[bytes], interval: float, window: float, trend: float) -> None:
        self.stream = stream
        self.interval, self.window, self.trend = interval, window, trend
        self.history: deque[Sample] = deque(maxlen=int(trend / interval) + 2)

    def __call__(self, sample: Sample) -> None:
        self.history.append(sample)
        window = compute_window(self.history, self.window, self.trend)
        self.stream.write(
            to_json(Snapshot(SCHEMA, self.interval, self.window, self.trend, sample, window))
        )
        self.stream.write(b"\n")
