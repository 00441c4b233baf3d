"""Fixtures of the deploy tests: a real Alertmanager on the example configuration, and real
scrapes of the exporter, the analyzer and the controller."""

from __future__ import annotations

import http.server
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from deploy_harness import (
    ALERTMANAGER,
    ROOT,
    Process,
    Scrapes,
    start,
)

from gpubalance.lab.fakenvml import write_state
from gpubalance.lab.live.ports import start_server

ALERTMANAGER_BINARY = "prometheus-alertmanager"  # Debian's name for the alertmanager binary


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[Process]:
    """deploy/alertmanager/alertmanager.yml in a real Alertmanager, alone (no cluster)."""
    if shutil.which(ALERTMANAGER_BINARY) is None:
        pytest.skip("alertmanager is missing: apt-get install prometheus-alertmanager")
    server = start_server(
        lambda address: [
            ALERTMANAGER_BINARY,
            f"--config.file={ALERTMANAGER}",
            f"--storage.path={tmp_path / 'data'}",
            f"--web.listen-address={address}",
            "--cluster.listen-address=",
        ],
        tmp_path / "alertmanager.log",
        timeout_seconds=30,
    )
    running = Process(server.process, server.log_path, server.url)
    yield running
    running.stop()


# -- real scrapes of the three processes, as small as they can be -----------------------------

FIXTURE_PROC = ROOT / "tests" / "fixtures" / "proc"  # processes 4242 and 4343 live here
MIB = 1024 * 1024
LAB_RUN = "lab run skewed-heterogeneous --speed fast --duration 300 --seed 1 --snapshots"
# OTLP on a free port too: tests run side by side
EXPORTER = "exporter --listen 127.0.0.1:0 --otlp-listen 127.0.0.1:0 --interval 0.2 --window 1"
EXPORTER += " --names both"
FAST_SERVICE = "--listen 127.0.0.1:0 --interval 0.5"


def _gpu_state(xid: str = "") -> dict[str, object]:
    state: dict[str, object] = {"device_count": 2, "driver_version": "550.54.14"}
    for i, pid in enumerate((4242, 4343)):
        p = f"gpu{i}."
        state |= {
            p + "uuid": f"GPU-0000000{i}-1111-2222-3333-44444444444{i}",
            p + "utilization.gpu": 60 + i,
            p + "memory.used": (8000 + i) * MIB,
            p + "throttle_reasons": 0x4,
            p + "procs": [(pid, 4096 * MIB)],
            p + "procs_util": [(pid, 55, 20, 0, 0)],
            p + "remapped_rows": "3:1:0:0",
            p + "xid": xid,
        }
    return state


class _VllmEndpoint(http.server.BaseHTTPRequestHandler):
    """A vLLM /metrics as a real vLLM serves it (the serving tests' fixture)."""

    body = (ROOT / "tests" / "exporter" / "serving" / "fixtures" / "vllm.txt").read_bytes()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def scrapes(
    fakenvml_env: Callable[[str | Path], dict[str, str]], tmp_path: Path
) -> Iterator[Scrapes]:
    """The exporter on the fake driver (both naming profiles, a vLLM endpoint, an XID), the
    analyzer on a short lab run, the controller on that analyzer and a missing HAProxy."""
    vllm = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _VllmEndpoint)
    threading.Thread(target=vllm.serve_forever, daemon=True).start()
    state_path = tmp_path / "nvml.state"
    write_state(state_path, _gpu_state())
    run_dir = tmp_path / "run"
    subprocess.run(
        [sys.executable, "-m", "gpubalance", *LAB_RUN.split(), "--out", str(run_dir)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    serving = tmp_path / "gpubalance.yaml"  # the vLLM endpoint feeds GPU 0
    vllm_url = f"http://127.0.0.1:{vllm.server_address[1]}/metrics"
    serving.write_text(
        "exporter:\n  serving:\n    endpoints:\n"
        f"      - {{url: '{vllm_url}', format: vllm, worker: vllm-0, gpu: 0}}\n"
    )
    started: list[Process] = []
    try:
        exporter = start(
            [
                *EXPORTER.split(),
                *("--procfs", str(FIXTURE_PROC)),
                *("--config", str(serving)),
            ],
            tmp_path / "exporter.log",
            fakenvml_env(state_path),
        )
        started.append(exporter)
        exporter.wait_for("/metrics", lambda t: "gpubalance_queue_depth{" in t)
        write_state(state_path, _gpu_state(xid="79"))  # an XID event after the start
        exporter_text = exporter.wait_for(
            "/metrics", lambda t: "gpubalance_gpu_xid_errors_total{" in t
        )
        analyzer = start(
            ["analyzer", "--source", str(run_dir), *FAST_SERVICE.split()],
            tmp_path / "analyzer.log",
        )
        started.append(analyzer)
        analyzer_text = analyzer.wait_for(
            "/metrics", lambda t: "gpubalance_worker_recommended_weight{" in t
        )
        controller = start(
            [
                *("controller", "--analyzer", analyzer.url, *FAST_SERVICE.split()),
                *("--haproxy-socket", str(tmp_path / "no-haproxy.sock")),
            ],
            tmp_path / "controller.log",
        )
        started.append(controller)
        controller_text = controller.wait_for(
            "/metrics", lambda t: "gpubalance_controller_cycle_duration_seconds_count 0" not in t
        )
        yield Scrapes(
            {"exporter": exporter_text, "analyzer": analyzer_text, "controller": controller_text},
            {"exporter": exporter.url, "analyzer": analyzer.url, "controller": controller.url},
        )
    finally:
        for process in started:
            process.stop()
        vllm.shutdown()
