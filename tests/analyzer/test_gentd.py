"""`gpubalance analyzer check-gentd`: the GenTD26 schema, on a small synthetic trace.

The real trace is for research only and never enters the repository: these files are made
up here, in its schema (one 57-s sample per pod, values scaled as the trace's are).
"""

from __future__ import annotations

import csv
import io
import tarfile
from pathlib import Path

import pytest

from gpubalance.analyzer import gentd
from gpubalance.analyzer.baselines import UtilizationThreshold
from gpubalance.analyzer.features import FeatureBuilder
from gpubalance.cli import main

T0 = 1_600_000_020.0
SAMPLES = 40  # 38 minutes: 8 windows of five samples
# pod -> (utilisation %, requests per sample, queueing ms)
PODS = {
    "pod-hot": (97.0, 3, 900.0),
    "pod-a": (55.0, 1, 150.0),
    "pod-b": (60.0, 1, 160.0),
    "pod-c": (50.0, 1, 140.0),
    "pod-idle": (0.0, 0, None),
}


def _write(
    folder: Path, stem: str, columns: list[str], rows: list[list[object]], archive: bool
) -> None:
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(columns)
    writer.writerows(rows)
    data = text.getvalue().encode()
    if not archive:
        (folder / f"{stem}.csv").write_bytes(data)
        return
    with tarfile.open(folder / f"{stem}.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo(f"{stem}.csv")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def make_trace(folder: Path, archive: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    util, memory, qps, queue = [], [], [], []
    for i in range(SAMPLES):
        t = T0 + 57 * i
        for pod, (busy, requests, wait) in PODS.items():
            util.append([busy, t, pod])  # column order differs per file, as in the trace
            memory.append([t, 20e9, pod])
            if requests:
                qps.append([t, requests * 0.09, pod, "Generative Requests"])
                queue.append([wait, pod, t])
        qps.append([t, 1.5, "", "API Requests"])  # gateway rows name no pod
    _write(
        folder,
        "pod_gpu_duty_cycle_anon",
        ["value", "timestamp_anon", "container_ip"],
        util,
        archive,
    )
    _write(
        folder,
        "pod_gpu_memory_used_bytes_anon",
        ["timestamp_anon", "value", "container_ip"],
        memory,
        archive,
    )
    _write(folder, "qps", ["timestamp_anon", "value", "container_ip", "request_type"], qps, archive)
    _write(folder, "queue_rt_raw_anon", ["value", "container_ip", "timestamp_anon"], queue, archive)
    return folder


@pytest.mark.parametrize("archive", [True, False])
def test_frames_and_serving_figures_per_pod_and_window(tmp_path: Path, archive: bool) -> None:
    trace = gentd.read(make_trace(tmp_path / "gentd", archive))
    assert trace.pods == len(PODS)
    assert len({f.t_start for f in trace.frames}) == SAMPLES // 5
    pods = sorted(PODS)  # pods are numbered in id order
    hot = pods.index("pod-hot")
    first = next(f for f in trace.frames if f.gpu == hot)
    assert first.sample_count == first.expected_sample_count == 5
    assert first.utilization_mean_ratio == pytest.approx(0.97)
    assert first.memory_used_bytes == 20_000_000_000
    assert first.completions_per_second is None and first.queue_depth_mean is None
    assert trace.serving[(hot, first.t_start)] == gentd.PodWindow(15, 900.0)
    assert trace.serving[(pods.index("pod-idle"), first.t_start)] == gentd.PodWindow(0, None)


def test_verdicts_are_checked_against_requests_and_queue_times(tmp_path: Path) -> None:
    trace = gentd.read(make_trace(tmp_path / "gentd"))
    rule = UtilizationThreshold().fit(FeatureBuilder().transform([]))
    figures = gentd.check(trace, {"threshold": rule})
    judged = figures["threshold"]
    # the idle pod is the one starved and the busy one the one overloaded (> 90 %)
    assert judged["starved_precision"] == judged["starved_recall"] == 1.0
    assert judged["overloaded_precision"] == judged["overloaded_recall"] == 1.0
    assert judged["starved_hot"] == 0.0
    states = judged["per_state"]
    assert states["starved"]["no_request_share"] == 1.0
    assert states["overloaded"]["queue_ms_median"] == 900.0
    assert states["balanced"]["requests_mean"] == 5.0
    assert figures["_trace"]["idle_share"] == pytest.approx(1 / 5)


def test_the_command_writes_aggregates_into_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = make_trace(tmp_path / "gentd")
    report = tmp_path / "EVALUATION.md"
    report.write_text(
        "# report\n\n<!-- eval:generated:start -->\nkept\n<!-- eval:generated:end -->\n"
    )
    assert main(["analyzer", "check-gentd", str(folder), "--report", str(report)]) == 0
    printed = capsys.readouterr().out
    text = report.read_text()
    assert "kept" in text and "Real telemetry: Alibaba GenTD26" in text
    assert "gpubalance analyzer check-gentd GENTD_DIR" in text
    assert "| utilization threshold | 20.0 % | 1.00 | 1.00 | 0.00 | 20.0 % | 1.00 | 1.00 |" in text
    for pod in PODS:  # numbers only: no identifier of the trace
        assert pod not in text and pod not in printed


def test_a_folder_that_is_not_the_trace_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["analyzer", "check-gentd", str(tmp_path)]) == 2
    assert (
        "no pod_gpu_duty_cycle_anon.csv or pod_gpu_duty_cycle_anon.tar.gz"
        in capsys.readouterr().err
    )
    folder = make_trace(tmp_path / "gentd", archive=False)
    (folder / "qps.csv").write_text("timestamp_anon,value\n1,2\n")
    assert main(["analyzer", "check-gentd", str(folder)]) == 2
    assert "qps.csv: no column container_ip, request_type" in capsys.readouterr().err
    (folder / "qps.csv").write_text("timestamp_anon,value,container_ip,request_type\nsoon,1,x,y\n")
    assert main(["analyzer", "check-gentd", str(folder)]) == 2
    assert "qps.csv:2: timestamp_anon and value must be numbers" in capsys.readouterr().err
    assert (
        main(["analyzer", "check-gentd", str(folder), "--model", str(tmp_path / "none.skops")]) == 2
    )
    assert "none.skops" in capsys.readouterr().err
