"""GPU memory in the live lab: each GPU shows its model plus the KV memory its worker's
allocator holds, as the exporter reads it through the fake driver."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from harness import run_live

from gpubalance.lab.live.run import LiveLab

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(
        shutil.which("haproxy") is None and not Path("/usr/sbin/haproxy").exists(),
        reason="HAProxy: sudo apt-get install haproxy",
    ),
]
MIB = 1024 * 1024

# Three GPUs, one worker each, w0 sent three times the requests of the others: its batches, and
# the KV memory they take, are larger.
SKEWED = {
    "name": "live-memory",
    "description": "one model on three GPUs, one worker busier than the others",
    "duration_seconds": 20,
    "hardware": {"gpus": [{"card": "RTX 4090", "count": 2}, {"card": "RTX 3090"}]},
    "models": {"small": {"params_billions": 3}},
    "workers": [{"gpu": "all", "model": "small", "max_batch_size": 16, "max_queue_delay_ms": 20}],
    "router": {"policy": "weighted_round_robin", "weights": {"w0": 3, "w1": 1, "w2": 1}},
    "traffic": [
        {
            "name": "chat",
            "class": "interactive",
            "arrivals": {"kind": "poisson", "rate": 10},
            "prompt_tokens": {"kind": "lognormal", "median": 800, "p90": 2000, "max": 4096},
            "output_tokens": {"kind": "lognormal", "median": 60, "p90": 150, "max": 400},
        }
    ],
}


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def memory_against_kv(lab: LiveLab) -> list[tuple[int, int, int]]:
    """Per GPU, (memory used the exporter reads, its model's fixed part, the KV its worker
    reserves), once the exporter shows every worker's KV as it is now (bounded wait: the lab
    rewrites the driver state 4 times a second, the exporter samples twice)."""
    assert lab.exporter is not None
    deadline = time.monotonic() + 5
    while True:
        kv = {
            w.gpu: get_json(f"http://127.0.0.1:{lab.configs[w.name].port}/state")[
                "kv_reserved_bytes"
            ]
            for w in lab.plan.workers
        }
        used = {
            g["index"]: g["memory_used_bytes"]
            for g in get_json(lab.exporter.url + "/api/v1/snapshot")["sample"]["gpus"]
        }
        fixed = {
            w.gpu: w.model.weights_bytes + w.model.overhead_mib * MIB for w in lab.plan.workers
        }
        rows = [(used[gpu], fixed[gpu], kv[gpu]) for gpu in sorted(kv)]
        if all(u == f + k for u, f, k in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def test_gpu_memory_follows_each_workers_kv(fakenvml_dir: Path) -> None:
    def probe(lab: LiveLab) -> list[list[tuple[int, int, int]]]:
        first = memory_against_kv(lab)
        time.sleep(3)
        return [first, memory_against_kv(lab)]

    _, _, (_, readings) = run_live(SKEWED, fakenvml_dir, probe)
    for rows in readings:
        for gpu, (used, fixed, kv) in enumerate(rows):
            assert kv > 0, (gpu, rows)  # the allocator holds memory for the requests
            assert used == fixed + kv, (gpu, used - fixed, kv)
        assert len({used for used, _, _ in rows}) == len(rows), rows  # each GPU its own
    # the busiest worker holds the most KV memory
    last = readings[-1]
    assert last[0][2] == max(kv for _, _, kv in last), last
