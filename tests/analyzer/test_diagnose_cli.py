"""`gpubalance diagnose`: JSON rows a program can read, a table a person can, clear errors."""

from __future__ import annotations

import csv
import json
import os
import pty
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import LISTENING, RunningExporter

from gpubalance.cli import main
from gpubalance.diagnosis import CAUSES, STATES
from gpubalance.lab import run as lab_run
from gpubalance.lab import scenario
from gpubalance.lab.fakenvml import write_state

ANSI = re.compile(r"\x1b\[")
ROW_TYPES = {
    "t_start": float,
    "t_end": float,
    "host": str,
    "gpu": int,
    "uuid": str,
    "pool": str,
    "state": str,
    "cause": str,
    "confidence": float,
    "evidence": list,
    "unknown_reason": (str, type(None)),
}


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


# the queue + utilization rule: what these tests' expectations of the skewed run were
# written for (the shipped model's own are in test_shipped_model.py and EVALUATION.md)
RULE = ("--classifier", "baseline-queue")


@pytest.fixture
def diagnose(capsys: pytest.CaptureFixture[str]) -> Callable[..., Result]:
    """diagnose(*args): `gpubalance diagnose ARGS` run in this process, its exit code and output."""

    def run(*args: str) -> Result:
        capsys.readouterr()
        try:
            code = main(["diagnose", *args])
        except SystemExit as exit:  # argparse's own errors and --help
            code = int(exit.code or 0)
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run


def _in_a_pipe(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpubalance", "diagnose", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("skewed")
    lab_run.run(scenario.load("skewed-heterogeneous"), "fast", 150, 1, out, snapshots=True)
    return out


@pytest.fixture(scope="module")
def settled_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same server for ten windows: its peers' load, a quarter of their capacity, lies near
    the line between starved and balanced (0.30), where the verdict step takes a few windows
    of the GPUs' own history to reach its enter confidence."""
    out = tmp_path_factory.mktemp("skewed-settled")
    lab_run.run(scenario.load("skewed-heterogeneous"), "fast", 300, 1, out, snapshots=True)
    return out


@pytest.fixture(scope="module")
def csv_dir(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("csv-only")
    shutil.copy(run_dir / "frames.csv", out / "frames.csv")
    return out


def _rows(result: Result) -> list[dict[str, object]]:
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert isinstance(rows, list) and rows
    return rows


def _check_rows(rows: list[dict[str, object]]) -> None:
    for row in rows:
        assert set(row) == set(ROW_TYPES)
        for key, kind in ROW_TYPES.items():
            assert isinstance(row[key], kind), (key, row)
        assert row["t_start"] < row["t_end"]  # type: ignore[operator]
        assert row["state"] in STATES and row["cause"] in CAUSES
        assert 0.0 <= row["confidence"] <= 1.0  # type: ignore[operator]
        evidence = row["evidence"]
        assert evidence and all(isinstance(s, str) and s for s in evidence)  # type: ignore[union-attr]
        assert (row["state"] == "unknown") == (row["unknown_reason"] is not None)


@pytest.mark.parametrize("source", ["run_dir", "csv_dir"])
def test_json_has_one_row_per_gpu_and_window(
    source: str, request: pytest.FixtureRequest, diagnose: Callable[..., Result]
) -> None:
    directory: Path = request.getfixturevalue(source)
    rows = _rows(diagnose("--from", str(directory), "--format", "json", *RULE))
    _check_rows(rows)
    assert len(rows) == 5 * 4  # 150 s in windows of 30 s, 4 GPUs
    assert {(r["gpu"], r["state"]) for r in rows if r["t_start"] == rows[-1]["t_start"]} == {
        (0, "overloaded"),
        (1, "starved"),
        (2, "starved"),
        (3, "starved"),
    }


def test_a_run_without_snapshots_says_what_its_frames_cannot_show(
    run_dir: Path, csv_dir: Path, diagnose: Callable[..., Result]
) -> None:
    recorded = diagnose("--from", str(run_dir), "--format", "json", *RULE)
    assert recorded.returncode == 0 and recorded.stderr == ""
    csv_only = diagnose("--from", str(csv_dir), "--format", "json", *RULE)
    assert _rows(csv_only)  # still judged, and the warning stays out of the JSON
    [warning] = csv_only.stderr.splitlines()
    assert warning.startswith(f"gpubalance diagnose: warning: {csv_dir} has no snapshots.jsonl")
    for said in ("no host CPU", "no serving queue names", "host_bound and io_bound go unseen"):
        assert said in warning
    assert warning.endswith("`gpubalance lab run` records them (its default, --snapshots)")


def test_the_csv_tells_the_same_story_as_the_snapshots(
    run_dir: Path, csv_dir: Path, diagnose: Callable[..., Result]
) -> None:
    # the rule reads figures both recordings hold; the CSV lacks some the model reads (clocks
    # against the card's maximum, request durations, host pressure, KV cache use)
    snapshots = _rows(diagnose("--from", str(run_dir), "--format", "json", *RULE))
    table = _rows(diagnose("--from", str(csv_dir), "--format", "json", *RULE))
    origin = snapshots[0]["t_start"]
    assert [(r["t_start"] - origin, r["gpu"]) for r in snapshots] == [  # type: ignore[operator]
        (r["t_start"], r["gpu"]) for r in table
    ]
    assert [r["state"] for r in snapshots] == [r["state"] for r in table]


def test_a_damaged_recording_gives_unknown_not_nan(
    csv_dir: Path, tmp_path: Path, diagnose: Callable[..., Result]
) -> None:
    with (csv_dir / "frames.csv").open(newline="") as stream:
        rows = list(csv.DictReader(stream))
    with (tmp_path / "frames.csv").open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            t, gpu = float(row["t"]), row["gpu"]
            if 60 < t <= 90 and gpu == "1":
                row["utilization"] = "nan"
            if 90 < t <= 120 and gpu == "2":
                row["queue_depth"], row["batch_size_mean"] = "nan", "inf"
            writer.writerow(row)
    verdicts = _rows(diagnose("--from", str(tmp_path), "--format", "json"))
    _check_rows(verdicts)
    words = {w for r in verdicts for s in r["evidence"] for w in re.findall(r"\w+", s)}  # type: ignore[union-attr]
    assert not words & {"nan", "inf"}
    blind = next(r for r in verdicts if r["gpu"] == 1 and r["t_start"] == 60)
    assert blind["unknown_reason"] == "the classifier cannot judge: no utilization reading"


def test_fleet_rows_and_the_window_option(run_dir: Path, diagnose: Callable[..., Result]) -> None:
    rows = _rows(diagnose("--from", str(run_dir), "--format", "json", "--fleet", "--window", "60"))
    assert len(rows) == 3  # 150 s: two whole windows of 60 s and a half one
    for row in rows:
        assert set(row) == {
            "t_start",
            "t_end",
            "host",
            "pool",
            "kind",
            "gpus",
            "idle_while_queued_ratio",
            "evidence",
        }
        assert row["gpus"] == [0, 1, 2, 3]
    assert rows[0]["kind"] == "imbalance"
    assert rows[0]["idle_while_queued_ratio"] > 0.2  # type: ignore[operator]
    assert rows[-1]["t_end"] - rows[-1]["t_start"] == 60  # type: ignore[operator]


def test_the_alert_baseline_is_one_option_away(
    run_dir: Path, diagnose: Callable[..., Result]
) -> None:
    args = ("--from", str(run_dir), "--format", "json", "--classifier", "baseline-threshold")
    causes = {(r["state"], r["cause"]) for r in _rows(diagnose(*args))}
    assert causes <= {("overloaded", "none"), ("starved", "low_demand"), ("balanced", "none")}


def test_the_table_reads_plainly_in_a_pipe(run_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "COLUMNS")}
    result = _in_a_pipe("--from", str(run_dir), *RULE, env=env)
    assert result.returncode == 0, result.stderr
    assert not ANSI.search(result.stdout + result.stderr)
    lines = result.stdout.splitlines()
    gpu0 = next(line for line in lines if re.match(r"│ 0 ", line))
    assert "overloaded" in gpu0 and "routing_skew" in gpu0 and "queue" in gpu0
    assert "OOOOO" in gpu0  # its timeline, one mark per window
    assert any("imbalance; idle while queued" in line for line in lines)
    assert "classifier: baseline-queue" in result.stdout


def test_the_default_is_the_shipped_model(
    settled_run_dir: Path, diagnose: Callable[..., Result]
) -> None:
    result = diagnose("--from", str(settled_run_dir))
    assert result.returncode == 0, result.stderr
    assert "classifier: model;" in result.stdout
    # the router's favourite's peers are starved by the routing, as the run's truth has them
    last = _rows(diagnose("--from", str(settled_run_dir), "--format", "json"))[-4:]
    assert [(r["gpu"], r["state"], r["cause"]) for r in last[1:]] == [
        (1, "starved", "routing_skew"),
        (2, "starved", "routing_skew"),
        (3, "starved", "routing_skew"),
    ]


def test_the_table_prints_names_as_they_are(
    csv_dir: Path,
    tmp_path: Path,
    diagnose: Callable[..., Result],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a pipe's table is 80 columns wide, and a long temporary path would wrap: widen it so that
    # the line is the name as given
    monkeypatch.setenv("COLUMNS", "400")
    odd = tmp_path / "[bold]run"  # a host named like rich markup stays a name
    odd.mkdir()
    shutil.copy(csv_dir / "frames.csv", odd / "frames.csv")
    result = diagnose("--from", str(odd))
    assert result.returncode == 0, result.stderr
    assert f"{odd}: 5 windows of 30 s" in result.stdout
    assert "pool (unnamed) on [bold]run: imbalance" in result.stdout


def test_the_table_has_colours_on_a_terminal(run_dir: Path) -> None:
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": "160"}
    env.pop("NO_COLOR", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "gpubalance", "diagnose", "--from", str(run_dir)],
        stdout=follower,
        stderr=follower,
        env=env,
    )
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the process is gone
            break
        if not chunk:
            break
        output += chunk
    os.close(leader)
    assert process.wait(timeout=60) == 0
    text = output.decode(errors="replace")
    assert ANSI.search(text) and "overloaded" in text


def test_bad_sources_exit_2_with_the_reason(
    tmp_path: Path, diagnose: Callable[..., Result]
) -> None:
    empty = diagnose("--from", str(tmp_path))
    assert empty.returncode == 2 and "not a lab run directory" in empty.stderr
    missing = diagnose("--from", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "neither a URL (http://, https://) nor a lab run" in (
        missing.stderr
    )
    dead = diagnose("--from", "http://127.0.0.1:9")
    assert dead.returncode == 2 and "neither a Prometheus API nor a gpubalance exporter" in (
        dead.stderr
    )
    assert "cannot reach Prometheus" in dead.stderr and "cannot reach the exporter" in dead.stderr
    (tmp_path / "frames.csv").write_text("t,gpu\n1,0\n")
    broken = diagnose("--from", str(tmp_path))
    assert broken.returncode == 2 and "missing columns utilization, uuid" in broken.stderr
    assert "Traceback" not in empty.stderr + missing.stderr + dead.stderr + broken.stderr
    (tmp_path / "frames.csv").write_text("t,gpu,uuid,utilization\n")
    nothing = diagnose("--from", str(tmp_path))  # readable, and nothing in it to judge
    assert nothing.returncode == 1 and "not one complete 30 s window to judge" in nothing.stderr


def test_bad_options_exit_2_with_the_reason(
    run_dir: Path, tmp_path: Path, diagnose: Callable[..., Result]
) -> None:
    cases = {
        ("--classifier", "magic"): "--classifier magic: unknown; one of model [FILE], baseline-",
        ("--classifier", "baseline-queue", "x"): "--classifier baseline-queue takes no file",
        ("--classifier", "model", "a", "b"): "--classifier model takes one FILE",
        ("--classifier", "model", str(tmp_path / "m.skops")): "m.skops: no such file",
        ("--fleet",): "--fleet goes with --format json",
        ("--window", "0.5"): "--window 0.5: need 0 < interval_seconds <= window_seconds",
        ("--window", "-3"): "expected a number of seconds above 0",
    }
    for args, message in cases.items():
        result = diagnose("--from", str(run_dir), *args)
        assert result.returncode == 2, (args, result.stdout)
        assert message in result.stderr, (args, result.stderr)


def test_help_says_the_shipped_model_is_the_default(
    diagnose: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps help at the terminal's width
    result = diagnose("--help")
    assert result.returncode == 0
    assert "model (the default: the model gpubalance ships" in result.stdout


def _exporter(env: dict[str, str], tmp_path: Path) -> RunningExporter:
    log_path = tmp_path / "exporter.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpubalance",
                "exporter",
                "--listen",
                "127.0.0.1:0",
                "--otlp-listen",  # never OTLP's fixed 4318: tests run side by side
                "127.0.0.1:0",
                "--interval",
                "0.2",
                "--window",
                "1",
                "--trend-window",
                "6",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    exporter = RunningExporter(process, "", log_path, Path(env["FAKE_NVML_STATE"]))
    deadline = time.monotonic() + 30
    while not (match := LISTENING.search(exporter.log())):
        assert process.poll() is None and time.monotonic() < deadline, exporter.log()
        time.sleep(0.05)
    exporter.url = match.group(1)
    return exporter


def test_an_exporter_with_a_hung_gpu(
    fakenvml_env: Callable[[str | Path], dict[str, str]],
    tmp_path: Path,
    diagnose: Callable[..., Result],
) -> None:
    state = tmp_path / "nvml.state"
    write_state(state, {"device_count": 2})
    exporter = _exporter(fakenvml_env(state), tmp_path)
    try:
        deadline = time.monotonic() + 30
        while exporter.get("/healthz")[0] != 200:
            assert time.monotonic() < deadline, exporter.log()
            time.sleep(0.05)
        # GPU 1's NVML reads now take 5 s each: it misses every sample's deadline
        exporter.write({"device_count": 2, "gpu1.delay_us": 5_000_000})
        deadline = time.monotonic() + 30
        hung: list[dict[str, object]] = []
        while len(hung) < 2:  # two whole windows of 1 s with GPU 1 stuck
            assert time.monotonic() < deadline, exporter.log()
            time.sleep(0.5)
            result = diagnose("--from", exporter.url, "--format", "json", "--window", "1")
            if result.returncode == 1:  # the exporter has not sampled a whole window yet
                assert "not one complete 1 s window to judge" in result.stderr
                continue
            rows = _rows(result)
            _check_rows(rows)
            hung = [r for r in rows if r["gpu"] == 1 and r["state"] == "unknown"]
        reason = str(hung[-1]["unknown_reason"])
        assert reason.startswith("NVML call hung in nvmlDevice"), reason
        # GPU 0 keeps its cadence: never hung, and judged in most of its 1 s windows (a loaded
        # machine can leave one of them short of samples, which is unknown for that reason)
        reasons = [r["unknown_reason"] for r in rows if r["gpu"] == 0]
        assert reasons and not any(str(r).startswith("NVML call hung") for r in reasons if r)
        assert reasons.count(None) >= len(reasons) / 2, reasons
    finally:
        exporter.write({"device_count": 2})
        exporter.stop()


def test_recommendations_show_under_the_table_and_as_json(
    run_dir: Path, diagnose: Callable[..., Result]
) -> None:
    table = diagnose("--from", str(run_dir))
    assert table.returncode == 0, table.stderr
    after = table.stdout.split("recommendations, cheapest first:", 1)[1]
    assert "set_weights pool:llama-3.2-3b" in after and "ρ by GPU now 0 " in after
    found = _rows(diagnose("--from", str(run_dir), "--format", "json", "--recommend"))
    weights = found[0]
    assert weights["action"] == "set_weights" and weights["cost_rank"] == 0
    expected = weights["expected"]
    assert isinstance(expected, dict) and set(expected["rho_after"]) == {"0", "1", "2"}
    assert diagnose("--from", str(run_dir), "--recommend").returncode == 2
