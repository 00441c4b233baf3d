"""A simulator process rewriting the state never tears a struct a reader gets.

The readers read until they have seen the state change enough times, however long a busy
machine makes that take; the rewriter runs until they are done."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import threading
import time

import pynvml as N
import pytest

MiB = 1 << 20
TOTAL = 48 << 30


def generation(g: int) -> dict[str, object]:
    """Every value of generation g derives from g, so a struct mixing two
    generations breaks one of the relations the readers check."""
    state: dict[str, object] = {"device_count": 4}
    for i in range(4):
        state |= {
            f"gpu{i}.memory.total": 48 << 30,
            f"gpu{i}.memory.used": g << 20,
            f"gpu{i}.memory.reserved": (g % 7) << 20,
            f"gpu{i}.utilization.gpu": g % 101,
            f"gpu{i}.utilization.memory": g % 101,
            f"gpu{i}.pci.device_id": g,
            f"gpu{i}.pci.subsystem_id": g ^ 0xFFFF,
            f"gpu{i}.procs": [(g, 2 * g), (g + 1, 2 * g + 2)],
        }
    return state


REWRITER = (
    inspect.getsource(generation)
    + """
import json, os, sys
from gpubalance.lab.fakenvml import write_state

path, stop = sys.argv[1], sys.argv[2]
g = 0
while not os.path.exists(stop):
    g += 1
    write_state(path, generation(g))
print(json.dumps(g))
"""
)


def check_device(h: object, generations: set[int]) -> list[str]:
    bad = []
    mem = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
    g = mem.used // MiB
    if mem.reserved != (g % 7) * MiB or mem.free != TOTAL - mem.used - mem.reserved:
        bad.append(f"memory {mem.used} {mem.reserved} {mem.free}")
    generations.add(g)
    util = N.nvmlDeviceGetUtilizationRates(h)
    if util.gpu != util.memory:
        bad.append(f"utilization {util.gpu} {util.memory}")
    pci = N.nvmlDeviceGetPciInfo(h)
    if pci.pciSubSystemId != pci.pciDeviceId ^ 0xFFFF:
        bad.append(f"pci {pci.pciDeviceId} {pci.pciSubSystemId}")
    procs = N.nvmlDeviceGetComputeRunningProcesses(h)
    # the size probe and the fill are two calls and may straddle a rewrite;
    # the entries of one call may not
    if procs:
        pid = procs[0].pid
        if [(p.pid, p.usedGpuMemory) for p in procs] != [(pid, 2 * pid), (pid + 1, 2 * pid + 2)]:
            bad.append(f"procs {[(p.pid, p.usedGpuMemory) for p in procs]}")
    return bad


@pytest.mark.timing
def test_rewriter_process_and_reader_threads(nvml, tmp_path):
    nvml.write(generation(0))
    handles = [N.nvmlDeviceGetHandleByIndex(i) for i in range(4)]
    stop = tmp_path / "stop"
    rewriter = subprocess.Popen(
        [sys.executable, "-c", REWRITER, str(nvml.state_path), str(stop)],
        stdout=subprocess.PIPE,
        text=True,
    )
    violations: list[str] = []
    generations: set[int] = set()
    calls = [0]
    lock = threading.Lock()
    deadline = time.monotonic() + 120

    def read() -> None:
        # each reader until it has seen 21 generations in 500 calls or more
        local_bad, local_gens, n = [], set(), 0
        while (len(local_gens) <= 20 or n < 500) and rewriter.poll() is None:
            if time.monotonic() > deadline:
                local_bad.append(f"saw {len(local_gens)} generations in {n} calls by the deadline")
                break
            for h in handles:
                try:
                    local_bad += check_device(h, local_gens)
                except N.NVMLError as e:  # e.g. a half-parsed state with fewer GPUs
                    local_bad.append(repr(e))
                n += 5  # the process list takes two C calls
        with lock:
            violations.extend(local_bad)
            generations.update(local_gens)
            calls[0] += n

    readers = [threading.Thread(target=read) for _ in range(4)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    stop.touch()
    rewrites = json.loads(rewriter.stdout.read())
    assert rewriter.wait() == 0
    assert violations == []
    assert calls[0] >= 2000
    assert rewrites > 20 and len(generations) > 20  # the readers really saw the file change
