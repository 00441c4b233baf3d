"""The state file writer and reader."""

from __future__ import annotations

import os

import pynvml as N
import pytest

from gpubalance.lab.fakenvml import THROTTLE_REASONS, read_state, render_state, write_state


def test_render_scalars_and_lists():
    text = render_state(
        {
            "device_count": 8,
            "driver_version": "550.54.14",
            "gpu*.persistence_mode": True,
            "gpu0.display_active": False,
            "gpu1.power.usage": 123.5,
            "gpu0.procs": [(1234, 1 << 30), (5678, 512 << 20), 42],
            "gpu0.procs_util": [(1234, 50, 20, 0, 0)],
            "gpu2.xid": [13, 79],
            "gpu2.remapped_rows": (1, 0, 0, 0),
            "gpu3.graphics_procs": [],
            "gpu3.throttle_reasons": "0x44",
        }
    )
    assert text.splitlines() == [
        "device_count = 8",
        "driver_version = 550.54.14",
        "gpu*.persistence_mode = 1",
        "gpu0.display_active = 0",
        "gpu1.power.usage = 123.5",
        "gpu0.procs = 1234:1073741824,5678:536870912,42",
        "gpu0.procs_util = 1234:50:20:0:0",
        "gpu2.xid = 13,79",
        "gpu2.remapped_rows = 1:0:0:0",
        "gpu3.graphics_procs = ",
        "gpu3.throttle_reasons = 0x44",
    ]


@pytest.mark.parametrize(
    ("state", "error"),
    [
        ({"gpu0.temp gpu": 1}, ValueError),
        ({"a=b": 1}, ValueError),
        ({"#gpu0.temp.gpu": 1}, ValueError),
        ({"gpu0.name": "two\nlines"}, ValueError),
        ({"gpu0.name": " padded"}, ValueError),
        ({"gpu0.procs": [(1, 2, 3)]}, ValueError),
        ({"gpu0.procs": {1: 2}}, TypeError),
        ({"gpu0.temp.gpu": None}, TypeError),
    ],
)
def test_render_refuses_what_the_file_cannot_carry(state, error):
    with pytest.raises(error):
        render_state(state)


def test_write_is_atomic_and_read_back(tmp_path):
    path = tmp_path / "state"
    state = {"device_count": 2, "gpu1.name": "NVIDIA RTX A6000 #1", "gpu0.xid": [13]}
    write_state(path, state)
    assert read_state(path) == {
        "device_count": "2",
        "gpu1.name": "NVIDIA RTX A6000 #1",
        "gpu0.xid": "13",
    }
    assert os.listdir(tmp_path) == ["state"]  # no temporary file left behind
    assert path.stat().st_mode & 0o777 == 0o644


def test_every_version_gets_a_new_mtime(tmp_path):
    # the library reloads on a changed stat identity; same-size rewrites within
    # one coarse timestamp tick must still differ
    path = tmp_path / "state"
    stamps = []
    for temp in (50, 51, 52, 53, 54):
        write_state(path, {"gpu0.temp.gpu": temp})
        stamps.append(path.stat().st_mtime_ns)
    assert stamps == sorted(set(stamps))


def test_read_state_skips_comments_and_rejects_garbage(tmp_path):
    path = tmp_path / "state"
    path.write_text("# a comment\n\n device_count = 3 \ngpu0.temp.gpu=40\ndevice_count = 4\n")
    assert read_state(path) == {"device_count": "4", "gpu0.temp.gpu": "40"}
    path.write_text("device_count 3\n")
    with pytest.raises(ValueError, match=":1:"):
        read_state(path)


def test_throttle_reasons_match_pynvml():
    names = {
        "gpu_idle": "GpuIdle",
        "applications_clocks_setting": "ApplicationsClocksSetting",
        "sw_power_cap": "SwPowerCap",
        "hw_slowdown": "HwSlowdown",
        "sync_boost": "SyncBoost",
        "sw_thermal_slowdown": "SwThermalSlowdown",
        "hw_thermal_slowdown": "HwThermalSlowdown",
        "hw_power_brake_slowdown": "HwPowerBrakeSlowdown",
        "display_clock_setting": "DisplayClockSetting",
        "board_limit": "BoardLimit",
        "reliability": "Reliability",
    }
    assert names.keys() == THROTTLE_REASONS.keys()
    for key, suffix in names.items():
        assert THROTTLE_REASONS[key] == getattr(N, f"nvmlClocksThrottleReason{suffix}")
