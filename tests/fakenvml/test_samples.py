"""nvmlDeviceGetSamples and process utilization follow a virtual sampling grid."""

from __future__ import annotations

import itertools
import os
import time

import pynvml as N
import pytest

PERIOD_US = 10_000


def mtime_us(path: os.PathLike[str]) -> int:
    return os.stat(path).st_mtime_ns // 1000


def test_samples_carry_each_state_from_its_file_mtime(nvml):
    base = {"device_count": 2, "gpu*.sample_period_us": PERIOD_US}
    nvml.write({**base, "gpu0.utilization.gpu": 10, "gpu0.power.usage": 100_000})
    first_us = mtime_us(nvml.state_path)
    h = N.nvmlDeviceGetHandleByIndex(0)
    time.sleep(0.15)
    nvml.write({**base, "gpu0.utilization.gpu": 90, "gpu0.power.usage": 200_000})
    changed_us = mtime_us(nvml.state_path)
    time.sleep(0.15)

    value_type, all_samples = N.nvmlDeviceGetSamples(h, N.NVML_GPU_UTILIZATION_SAMPLES, 0)
    assert value_type == N.NVML_VALUE_TYPE_UNSIGNED_INT
    stamps = [s.timeStamp for s in all_samples]
    assert all(b - a == PERIOD_US for a, b in itertools.pairwise(stamps))
    # the grid began with the fixture's state (utilization 0) at nvmlInit
    expected = [0 if ts < first_us else 10 if ts < changed_us else 90 for ts in stamps]
    assert [s.sampleValue.uiVal for s in all_samples] == expected

    samples = [s for s in all_samples if s.timeStamp >= first_us]
    stamps = [s.timeStamp for s in samples]
    values = [s.sampleValue.uiVal for s in samples]
    assert {10, 90} <= set(values)

    # the window average is the time-weighted average of the file's values
    start, end = stamps[0], stamps[-1] + PERIOD_US
    weighted = (10 * (changed_us - start) + 90 * (end - changed_us)) / (end - start)
    assert abs(sum(values) / len(values) - weighted) <= 80 / len(values)

    _, power = N.nvmlDeviceGetSamples(h, N.NVML_TOTAL_POWER_SAMPLES, first_us - 1)
    assert {s.sampleValue.uiVal for s in power} == {100_000, 200_000}

    # only samples newer than lastSeen come back
    last = stamps[-1]
    try:
        _, newer = N.nvmlDeviceGetSamples(h, N.NVML_GPU_UTILIZATION_SAMPLES, last)
    except N.NVMLError_NotFound:
        newer = []
    assert all(s.timeStamp > last for s in newer)


def test_samples_not_found_until_the_next_grid_point(nvml):
    nvml.write({"device_count": 1, "gpu0.sample_period_us": 60_000_000})
    h = N.nvmlDeviceGetHandleByIndex(0)
    _, first = N.nvmlDeviceGetSamples(h, N.NVML_MEMORY_UTILIZATION_SAMPLES, 0)
    assert len(first) == 1
    with pytest.raises(N.NVMLError_NotFound):
        N.nvmlDeviceGetSamples(h, N.NVML_MEMORY_UTILIZATION_SAMPLES, first[0].timeStamp)
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceGetSamples(h, N.NVML_MODULE_POWER_SAMPLES, 0)


def test_sample_ring_keeps_120_points(nvml):
    nvml.write({"device_count": 1, "gpu0.sample_period_us": 1000, "gpu0.utilization.decoder": 7})
    time.sleep(0.2)
    h = N.nvmlDeviceGetHandleByIndex(0)
    _, samples = N.nvmlDeviceGetSamples(h, N.NVML_DEC_UTILIZATION_SAMPLES, 0)
    assert len(samples) == 120
    assert {s.sampleValue.uiVal for s in samples} == {7}


def test_process_utilization_stamps_the_latest_grid_point(nvml):
    nvml.write(
        {
            "device_count": 2,
            "gpu*.sample_period_us": 60_000_000,
            "gpu0.procs_util": [(4242, 60, 30, 0, 0)],
        }
    )
    h = N.nvmlDeviceGetHandleByIndex(0)
    (sample,) = N.nvmlDeviceGetProcessUtilization(h, 0)
    assert (sample.pid, sample.smUtil, sample.memUtil) == (4242, 60, 30)
    _, grid = N.nvmlDeviceGetSamples(h, N.NVML_GPU_UTILIZATION_SAMPLES, 0)
    assert sample.timeStamp == grid[-1].timeStamp
    with pytest.raises(N.NVMLError_NotFound):
        N.nvmlDeviceGetProcessUtilization(h, sample.timeStamp)
    with pytest.raises(N.NVMLError_NotFound):  # an idle GPU
        N.nvmlDeviceGetProcessUtilization(N.nvmlDeviceGetHandleByIndex(1), 0)


@pytest.mark.timing
def test_reload_interval_defers_the_reload_not_the_sample_times(nvml, monkeypatch):
    N.nvmlShutdown()
    # the file is checked every 1.5 s: far more than the 60 ms this test takes to its
    # "not noticed yet", however busy the machine
    monkeypatch.setenv("FAKE_NVML_RELOAD", "1500000")
    state = {"device_count": 1, "gpu0.sample_period_us": PERIOD_US}
    nvml.write({**state, "gpu0.utilization.gpu": 10})
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    time.sleep(0.03)
    nvml.write({**state, "gpu0.utilization.gpu": 90})
    changed_us = mtime_us(nvml.state_path)
    time.sleep(0.03)
    assert N.nvmlDeviceGetUtilizationRates(h).gpu == 10  # not noticed yet
    N.nvmlDeviceGetSamples(h, N.NVML_GPU_UTILIZATION_SAMPLES, 0)  # grid moves past the change
    time.sleep(1.55)
    assert N.nvmlDeviceGetUtilizationRates(h).gpu == 90
    _, samples = N.nvmlDeviceGetSamples(h, N.NVML_GPU_UTILIZATION_SAMPLES, 0)
    # points after the change were filled before it was noticed, yet carry the new value
    assert [s.sampleValue.uiVal for s in samples] == [
        10 if s.timeStamp < changed_us else 90 for s in samples
    ]
