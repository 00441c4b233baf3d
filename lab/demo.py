"""`make demo`: a 4-GPU RTX box (3x RTX 4090 + 1x RTX 3090) on the fake driver, its values
moving over time, the exporter reading it through pynvml, and the live terminal view.

The load is skewed on purpose (GPU 0 is the default target, the RTX 3090 idles), so the view
shows what gpubalance is for.
"""

from __future__ import annotations

import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from gpubalance.lab.catalogue import CARDS, MIB, Card
from gpubalance.lab.fakenvml import build_library, write_state

DEMO_CARDS = ("RTX 4090", "RTX 4090", "RTX 4090", "RTX 3090")
# Mean offered load per GPU: one hot default target, one idling card.
DEMO_LOAD = (0.93, 0.55, 0.35, 0.08)


def static_state(index: int, card: Card) -> dict[str, object]:
    """Identity and limits of one card, in the fake driver's state keys."""
    prefix = f"gpu{index}."
    return {
        prefix + "name": card.model,
        prefix + "uuid": f"GPU-{index:08x}-6a1b-4c2d-9e3f-{0x4090_0000 + index:012x}",
        prefix + "pci.bus_id": f"00000000:{index + 1:02X}:00.0",
        prefix + "pci.device_id": f"0x{card.pci_device_id:04X}10DE",
        prefix + "cuda_cc": card.cuda_cc,
        prefix + "memory.total": card.memory_total_bytes,
        prefix + "memory.reserved": 333 * MIB,
        prefix + "power.limit": int(card.power_limit_watts * 1000),
        prefix + "power.default_limit": int(card.power_limit_watts * 1000),
        prefix + "clock.max.sm": card.max_sm_clock_mhz,
        prefix + "clock.max.graphics": card.max_sm_clock_mhz,
        prefix + "clock.max.mem": card.memory_clock_mhz,
    }


class DemoAnimator:
    """Rewrites the state file a few times a second with loads that drift around DEMO_LOAD."""

    def __init__(self, state_path: Path, worker_pids: list[int], seed: int = 1) -> None:
        self.state_path = state_path
        self.worker_pids = worker_pids
        self.random = random.Random(seed)
        self.started = time.monotonic()
        self.energy_mj = [0.0] * len(DEMO_CARDS)
        self.leak = [0.0] * len(DEMO_CARDS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-animator", daemon=True)

    def state(self) -> dict[str, object]:
        t = time.monotonic() - self.started
        state: dict[str, object] = {"device_count": len(DEMO_CARDS), "driver_version": "550.54.14"}
        for i, name in enumerate(DEMO_CARDS):
            card = CARDS[name]
            state.update(static_state(i, card))
            load = DEMO_LOAD[i] + 0.06 * math.sin(t / 7 + i) + self.random.uniform(-0.03, 0.03)
            load = min(1.0, max(0.0, load))
            idle_w = 0.07 * card.power_limit_watts
            power_w = idle_w + load * (card.power_limit_watts - idle_w)
            throttled = power_w >= 0.97 * card.power_limit_watts
            self.energy_mj[i] += power_w * 0.5 * 1000
            # GPU 0 also leaks memory slowly, so its trend and time-to-full move.
            self.leak[i] += 24 * MIB * 0.5 if i == 0 else 0
            weights = int(card.memory_total_bytes * 0.55)
            used = min(
                card.memory_total_bytes - 400 * MIB,
                int(weights + load * 0.25 * card.memory_total_bytes + self.leak[i]),
            )
            pid = self.worker_pids[i]
            prefix = f"gpu{i}."
            state.update(
                {
                    prefix + "utilization.gpu": round(100 * min(1.0, load * 1.08)),
                    prefix + "utilization.memory": round(60 * load),
                    prefix + "memory.used": used,
                    prefix + "temp.gpu": round(34 + 48 * load),
                    prefix + "power.usage": int(power_w * 1000),
                    prefix + "energy": int(self.energy_mj[i]),
                    prefix + "clock.sm": int(card.boost_clock_mhz * (0.93 if throttled else 1.0)),
                    prefix + "clock.graphics": int(
                        card.boost_clock_mhz * (0.93 if throttled else 1.0)
                    ),
                    prefix + "clock.mem": card.memory_clock_mhz,
                    prefix + "throttle_reasons": 0x4 if throttled else (0x1 if load < 0.05 else 0),
                    prefix + "pcie.tx": int(9000 * load),
                    prefix + "pcie.rx": int(42000 * load),
                    prefix + "fan.speed": round(30 + 60 * load),
                    prefix + "procs": [(pid, used - weights // 20)],
                    prefix + "procs_util": [(pid, round(100 * load), round(60 * load), 0, 0)],
                }
            )
        return state

    def write(self) -> None:
        write_state(self.state_path, self.state())

    def start(self) -> None:
        self.write()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.write()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")
        time.sleep(0.1)


def start_exporter(
    library_dir: Path, state_path: Path, port: int, extra_env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(extra_env or {})
    env["LD_LIBRARY_PATH"] = f"{library_dir}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    env["FAKE_NVML_STATE"] = str(state_path)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpubalance",
            "exporter",
            "--listen",
            f"127.0.0.1:{port}",
            "--window",
            "10",
            "--trend-window",
            "60",
            "--log-level",
            "warning",
        ],
        env=env,
    )


def run_demo(build_dir: Path, duration: float | None) -> int:
    from gpubalance.exporter.top import watch

    library_dir = build_library(build_dir).parent
    with tempfile.TemporaryDirectory(prefix="gpubalance-demo-") as tmp:
        state_path = Path(tmp) / "nvml.state"
        # Real processes stand in for the serving workers, so NVML's PIDs resolve on the host.
        workers = [subprocess.Popen(["sleep", "86400"]) for _ in DEMO_CARDS]
        animator = DemoAnimator(state_path, [w.pid for w in workers])
        animator.start()
        port = free_port()
        exporter = start_exporter(library_dir, state_path, port)
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz")
            print(f"exporter on http://127.0.0.1:{port}/metrics (fake NVML: {library_dir})")
            return watch(f"http://127.0.0.1:{port}", refresh=1.0, duration=duration)
        finally:
            exporter.terminate()
            exporter.wait(timeout=10)
            animator.stop()
            for worker in workers:
                worker.kill()
                worker.wait()
