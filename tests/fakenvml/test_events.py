"""XID events: each XID added to a device's `xid` list is delivered once."""

from __future__ import annotations

import ctypes
import threading
import time

import pynvml as N
import pytest

XID = N.nvmlEventTypeXidCriticalError


@pytest.fixture
def event_set(nvml):
    nvml.write({"device_count": 4, "gpu0.xid": [13], "gpu2.xid": [79]})
    event_set = N.nvmlEventSetCreate()
    for i in (0, 1, 2):
        N.nvmlDeviceRegisterEvents(N.nvmlDeviceGetHandleByIndex(i), XID, event_set)
    yield event_set
    N.nvmlEventSetFree(event_set)


def drain(event_set) -> list[tuple[int, int]]:
    events = []
    while True:
        try:
            data = N.nvmlEventSetWait_v2(event_set, 0)
        except N.NVMLError_Timeout:
            return events
        assert data.eventType == XID
        events.append((N.nvmlDeviceGetIndex(data.device), data.eventData))


def test_new_xids_are_delivered_once_each(nvml, event_set):
    assert drain(event_set) == []  # XIDs from before registration are history
    nvml.write({"device_count": 4, "gpu0.xid": [13, 31], "gpu2.xid": [79, 48, 94]})
    assert drain(event_set) == [(0, 31), (2, 48), (2, 94)]
    assert drain(event_set) == []
    nvml.write({"device_count": 4, "gpu0.xid": [13, 31, 43], "gpu2.xid": [79, 48, 94]})
    assert drain(event_set) == [(0, 43)]


def test_rewritten_shorter_list_starts_over(nvml, event_set):
    nvml.write({"device_count": 4, "gpu0.xid": []})
    assert drain(event_set) == []
    nvml.write({"device_count": 4, "gpu0.xid": [62]})
    assert drain(event_set) == [(0, 62)]


def test_unregistered_and_lost_devices_deliver_nothing(nvml, event_set):
    nvml.write({"device_count": 4, "gpu2.lost": 1, "gpu2.xid": [79, 48], "gpu3.xid": [45]})
    assert drain(event_set) == []


@pytest.mark.timing
def test_wait_times_out_then_wakes_for_a_new_xid(nvml, event_set):
    start = time.monotonic()
    with pytest.raises(N.NVMLError_Timeout):
        N.nvmlEventSetWait_v2(event_set, 100)
    assert time.monotonic() - start >= 0.1

    writer = threading.Timer(
        0.05, nvml.write, args=({"device_count": 4, "gpu0.xid": [13], "gpu1.xid": [119]},)
    )
    writer.start()
    data = N.nvmlEventSetWait_v2(event_set, 5000)
    writer.join()
    assert (N.nvmlDeviceGetIndex(data.device), data.eventData) == (1, 119)


def test_supported_types_and_legacy_wait(nvml, event_set):
    h = N.nvmlDeviceGetHandleByIndex(0)
    assert N.nvmlDeviceGetSupportedEventTypes(h) == XID
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceRegisterEvents(h, N.nvmlEventTypePState, event_set)
    nvml.write({"device_count": 4, "gpu0.xid": [13, 92]})
    legacy = (ctypes.c_uint64 * 4)(0, 0, 0, 0xDEAD)  # device, type, data; 4th is untouched
    assert nvml.lib.nvmlEventSetWait(event_set, ctypes.byref(legacy), ctypes.c_uint(0)) == 0
    assert list(legacy[1:]) == [XID, 92, 0xDEAD]
