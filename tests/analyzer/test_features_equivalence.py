"""The feature builder gives the numbers the trained model was fitted on.

FeatureBuilder works per pool and window on numpy arrays; tests/analyzer/features_reference.py
is the builder as it was (a row at a time in Python), frozen. Both read the same frames: every
generated lab family over more windows than the history keeps, as hosts of one fleet (so one
card's best served rate crosses hosts as it does in a fleet), and the same fleet with readings
missing, frames dropped and GPUs lost, as real telemetry has them.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import numpy as np
import pytest
from analyzer_harness import frozen, generated_fleet

from gpubalance.analyzer.features import COLUMNS, FeatureBuilder, FeatureStream, FeatureTable
from gpubalance.analyzer.frames import GpuFrame

# more windows than the features' history (20) and a batch-time fit's points (60 over 8 GPUs)
DURATION_SECONDS = 720.0
# the frame fields a source may not deliver (None) in a window
OPTIONAL = tuple(f.name for f in dataclasses.fields(GpuFrame) if "None" in str(f.type))


@pytest.fixture(scope="module")
def fleet() -> list[GpuFrame]:
    """Every family's first variant as a host of its own, its GPUs' UUIDs its own."""
    return generated_fleet(DURATION_SECONDS)


def _damaged(frames: Sequence[GpuFrame], seed: int) -> list[GpuFrame]:
    """Readings missing at random, frames dropped, GPUs lost and queues gone for a window."""
    rng = random.Random(seed)
    out = []
    for frame in frames:
        if rng.random() < 0.05:
            continue
        changes: dict[str, object] = {name: None for name in OPTIONAL if rng.random() < 0.08}
        if rng.random() < 0.03:
            changes["lost"] = True
        if rng.random() < 0.03:
            changes["sample_count"] = 0
        if rng.random() < 0.04:
            changes["queue_names"] = ()
            changes["serving_queues"] = 0
        out.append(dataclasses.replace(frame, **changes))
    return out


def _assert_same(new: FeatureTable, old: object) -> None:
    assert new.columns == COLUMNS
    assert [(f.t_start, f.host, f.uuid) for f in new.frames] == [
        (f.t_start, f.host, f.uuid)
        for f in old.frames  # type: ignore[attr-defined]
    ]
    expected = old.values  # type: ignore[attr-defined]
    for index, name in enumerate(COLUMNS):
        np.testing.assert_allclose(
            new.values[:, index],
            expected[:, index],
            rtol=1e-9,
            atol=1e-12,
            equal_nan=True,
            err_msg=name,
        )


# about 45 s of lab runs to set up and as long again alone on 2 cores; the limit bounds a hang
# (the default 300 s passed once with the machine at load 15)
@pytest.mark.timeout(900)
def test_a_fleet_of_every_family_gets_the_same_features(fleet: list[GpuFrame]) -> None:
    assert len(fleet) > 2000
    _assert_same(
        FeatureBuilder().transform(fleet),
        frozen("features_reference").FeatureBuilder().transform(fleet),
    )


@pytest.mark.parametrize("seed", [1, 2])
def test_damaged_telemetry_gets_the_same_features(fleet: list[GpuFrame], seed: int) -> None:
    frames = _damaged(fleet, seed)
    _assert_same(
        FeatureBuilder().transform(frames),
        frozen("features_reference").FeatureBuilder().transform(frames),
    )


def test_one_host_alone_gets_the_same_features(fleet: list[GpuFrame]) -> None:
    frames = [f for f in fleet if f.host == "host-01"]
    _assert_same(
        FeatureBuilder().transform(frames),
        frozen("features_reference").FeatureBuilder().transform(frames),
    )


def test_a_stream_fed_a_lookback_per_cycle_makes_the_same_final_rows(
    fleet: list[GpuFrame],
) -> None:
    # every cycle reads the last 6 windows; the newest arrives short of its last GPUs (a
    # scrape on its way) and comes whole in the next cycle's read
    windows = sorted({f.t_start for f in fleet})
    stream = FeatureStream()
    rows: dict[tuple[float, str, str], np.ndarray] = {}
    for end in range(1, len(windows) + 1):
        lookback = set(windows[max(0, end - 6) : end])
        pulled = [f for f in fleet if f.t_start in lookback]
        if end < len(windows):
            pulled = [f for f in pulled if f.t_start != windows[end - 1] or f.gpu < 2]
        table = stream.add(pulled)
        assert {f.t_start for f in table.frames} <= set(windows[max(0, end - 2) : end])
        for frame, values in zip(table.frames, table.values, strict=True):
            rows[(frame.t_start, frame.host, frame.uuid)] = values
    whole = FeatureBuilder().transform(fleet)
    assert len(rows) == len(whole.frames)
    expected = np.array([rows[(f.t_start, f.host, f.uuid)] for f in whole.frames])
    np.testing.assert_allclose(expected, whole.values, rtol=1e-9, atol=1e-12, equal_nan=True)
