"""gpubalance report: an HTML page of a recorded lab run, drawn in a real headless Chromium.

The run is the lab's (fast speed, with snapshots); the controller's actions are written with the
controller's own AuditLog, as a controller run beside it records them.
"""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from gpubalance.analyzer.report import STATE_COLOURS, gpu_figure, load_run
from gpubalance.controller.audit import AuditLog

SCENARIO = "default-target"  # w0 overloaded, its peers starved, until a weight fix at 240 s
DURATION_SECONDS = 300


def _gpubalance(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpubalance", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run")
    result = _gpubalance(
        "lab", "run", SCENARIO, "--speed", "fast", "--duration", DURATION_SECONDS,
        "--seed", "1", "--snapshots", "--out", out,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    origin = load_run(out).origin
    audit = AuditLog(out / "gpubalance-controller-audit.jsonl")
    audit.record(origin + 200, "waiting", recommendation="r1", target="be_gpu/w0", reason="dwell")
    audit.record(
        origin + 230, "applied", recommendation="r1", target="be_gpu/w0", action="set_weights",
        reason="weights of the pool", before={"weight": 100}, after={"weight": 40},
    )  # fmt: skip
    audit.close()
    return out


@pytest.fixture(scope="module")
def report(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report") / "report.html"
    result = _gpubalance("report", "--from", run_dir, "--out", out)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr, result.stderr
    assert "4 GPUs" in result.stdout and "1 controller actions" in result.stdout
    return out


def _images(page: str) -> list[Image.Image]:
    sources = re.findall(r'<img [^>]*src="([^"]+)"', page)
    images = []
    for source in sources:
        assert source.startswith("data:image/png;base64,"), source[:60]
        image = Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1])))
        image.load()  # decodes the whole PNG: a truncated one raises here
        images.append(image.convert("RGB"))
    return images


def _colour_pixels(image: Image.Image, colour: str) -> int:
    target = tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))
    counts = image.getcolors(maxcolors=1 << 24) or []
    return sum(
        n for n, rgb in counts if all(abs(a - b) <= 2 for a, b in zip(rgb, target, strict=True))
    )


def _screenshot(page: Path, out: Path) -> Image.Image:
    browser = shutil.which("chromium")
    if browser is None:
        pytest.skip("headless Chromium draws the report: apt-get install chromium")
    result = subprocess.run(
        [
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={out.parent / 'profile'}", "--window-size=1200,5200",
            f"--screenshot={out}", page.as_uri(),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0 and out.is_file(), result.stderr
    return Image.open(out).convert("RGB")


def test_report_is_one_self_contained_page(report: Path) -> None:
    page = report.read_text()
    # nothing fetched: no scripts, stylesheets or remote sources
    assert "<script" not in page and "<link" not in page
    assert not re.search(r'(src|href)="(?!data:)', page)
    # the fleet figure and one per GPU, each a whole PNG with something drawn in it
    images = _images(page)
    assert len(images) == 1 + 4
    for image in images:
        assert image.width > 600 and image.height > 200
        assert len(image.getcolors(maxcolors=1 << 24) or []) > 50  # not a blank canvas


def test_verdicts_and_truth_are_colour_bands(report: Path, run_dir: Path) -> None:
    _fleet, hot, *peers = _images(report.read_text())
    # GPU 0 is judged overloaded; the truth turns balanced after the weight fix
    assert _colour_pixels(hot, STATE_COLOURS["overloaded"]) > 5000
    assert _colour_pixels(hot, STATE_COLOURS["balanced"]) > 1000
    for image in peers:
        assert _colour_pixels(image, STATE_COLOURS["starved"]) > 5000
    page = report.read_text()
    assert "overloaded (routing_skew)" in page and "ground truth from truth.csv" in page


def test_controller_actions_are_marked(report: Path, run_dir: Path) -> None:
    page = report.read_text()
    assert "<h2>Controller actions</h2>" in page
    assert "set_weights" in page and "be_gpu/w0" in page
    assert "dwell" not in page  # a decision that changed nothing is not an action
    # the marker is on w0's GPU only
    run = load_run(run_dir)
    without = load_run(run_dir)
    without.actions = []
    host = run.timeline[0].host
    assert gpu_figure(run, host, 0) != gpu_figure(without, host, 0)
    assert gpu_figure(run, host, 1) == gpu_figure(without, host, 1)


def test_chromium_draws_the_plots(report: Path, tmp_path: Path) -> None:
    page = report.read_text()
    shot = _screenshot(report, tmp_path / "report.png")
    # the page without its images, drawn the same way: what the plots add is theirs
    bare = tmp_path / "bare.html"
    bare.write_text(re.sub(r'src="data:[^"]+"', 'src=""', page))
    blank = _screenshot(bare, tmp_path / "bare.png")
    images = _images(page)
    for state in ("overloaded", "starved", "balanced"):
        colour = STATE_COLOURS[state]
        # the plots are narrower than the page: shown 1:1, every band pixel is on the screen
        expected = sum(_colour_pixels(image, colour) for image in images)
        drawn = _colour_pixels(shot, colour)
        assert expected > 1000
        assert drawn >= 0.95 * expected, f"{state}: {drawn} of {expected} pixels drawn"
        assert _colour_pixels(blank, colour) == 0


def test_report_reads_a_run_without_snapshots(run_dir: Path, tmp_path: Path) -> None:
    csv_only = tmp_path / "run"
    csv_only.mkdir()
    for name in ("frames.csv", "truth.csv"):
        shutil.copy(run_dir / name, csv_only / name)
    out = tmp_path / "report.html"
    result = _gpubalance("report", "--from", csv_only, "--out", out)
    assert result.returncode == 0, result.stderr
    assert len(_images(out.read_text())) == 5
    # it says what a frames.csv cannot show, once; a run with its snapshots gets no warning
    assert result.stderr.count("gpubalance report: warning: ") == 1, result.stderr
    assert f"{csv_only} has no snapshots.jsonl" in result.stderr


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "not a lab run directory"),
        ({"frames.csv": "t,gpu\n1,0\n"}, "missing columns"),
    ],
)
def test_report_refuses_what_is_not_a_run(
    tmp_path: Path, files: dict[str, str], message: str
) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    result = _gpubalance("report", "--from", tmp_path, "--out", tmp_path / "r.html")
    assert result.returncode == 2
    assert message in result.stderr, result.stderr
    assert not (tmp_path / "r.html").exists()


def test_report_says_when_it_cannot_write(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "missing" / "r.html"
    result = _gpubalance("report", "--from", run_dir, "--out", out)
    assert result.returncode == 2
    assert f"--out {out}: cannot write: No such file or directory" in result.stderr


def test_report_names_a_bad_audit_line(run_dir: Path, tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    audit.write_text('{"decision": "applied", "at_seconds": 1}\nnot json\n')
    result = _gpubalance(
        "report", "--from", run_dir, "--out", tmp_path / "r.html", "--audit-log", audit
    )
    assert result.returncode == 2
    assert f"{audit}:2: not a controller audit line" in result.stderr
