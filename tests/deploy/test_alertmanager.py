"""The example Alertmanager routing: valid for amtool, every alert reaching the receiver of its
severity, and inhibitions that silence warnings under the matching critical (in a real
Alertmanager)."""

from __future__ import annotations

import time

import pytest
from deploy_harness import ALERTMANAGER, Process, alerts, needs, run

RECEIVER_OF = {
    "critical": "gpubalance-pager",
    "warning": "gpubalance-ticket",
    "info": "gpubalance-low-noise",
}


def route(*labels: str) -> str:
    result = run("amtool", "config", "routes", "test", f"--config.file={ALERTMANAGER}", *labels)
    return result.stdout.strip()


@needs("amtool", "prometheus-alertmanager")
def test_amtool_checks_the_config() -> None:
    run("amtool", "check-config", ALERTMANAGER)


@needs("amtool", "prometheus-alertmanager")
@pytest.mark.parametrize("alert", alerts(), ids=lambda a: a["alert"])
def test_each_alert_reaches_the_receiver_of_its_severity(alert: dict) -> None:
    severity = alert["labels"]["severity"]
    labels = [f"alertname={alert['alert']}", f"severity={severity}", "instance=gpu-host-1"]
    assert route(*labels) == RECEIVER_OF[severity]


@needs("amtool", "prometheus-alertmanager")
def test_other_alerts_keep_the_default_receiver() -> None:
    assert route("alertname=NodeDown", "severity=critical") == "default"


def _alert(name: str, severity: str, **labels: str) -> dict:
    return {"labels": {"alertname": name, "severity": severity, **labels}}


def test_a_critical_inhibits_the_warnings_of_the_same_gpu_or_host(
    alertmanager: Process,
) -> None:
    gpu2 = {"instance": "gpu-host-1", "gpu": "2", "uuid": "GPU-2"}
    analyzer = {"instance": "127.0.0.1:9451", "host": "gpu-host-1", "gpu": "2", "uuid": "GPU-2"}
    posted = {
        "lost": _alert("GPUBalanceGpuLost", "critical", **gpu2),
        "throttled, same GPU": _alert("GPUBalanceGpuThrottled", "warning", **gpu2),
        "throttled, other GPU": _alert(
            "GPUBalanceGpuThrottled", "warning", instance="gpu-host-1", gpu="0", uuid="GPU-0"
        ),
        "unknown, same GPU": _alert("GPUBalanceAnalyzerUnknown", "warning", **analyzer),
        "exporter down": _alert("GPUBalanceExporterDown", "critical", instance="gpu-host-2"),
        "source stale, same host": _alert(
            "GPUBalanceServingSourceStale", "warning", instance="gpu-host-2", source="vllm"
        ),
    }
    alertmanager.json("/api/v2/alerts", list(posted.values()))
    suppressed = {"throttled, same GPU", "unknown, same GPU", "source stale, same host"}
    deadline = time.monotonic() + 30
    while True:
        states = {
            key: state
            for a in alertmanager.json("/api/v2/alerts")
            for key, sent in posted.items()
            if a["labels"] == sent["labels"]
            for state in [a["status"]["state"]]
        }
        expected = {k: "suppressed" if k in suppressed else "active" for k in posted}
        if states == expected:
            break
        assert time.monotonic() < deadline, f"states {states}, expected {expected}"
        time.sleep(0.2)
