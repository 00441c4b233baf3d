"""`gpubalance analyzer train`: generated runs in, a skops model and its report out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import run_on_terminal

from gpubalance.analyzer import model
from gpubalance.analyzer.evaluate import generated_examples
from gpubalance.analyzer.train import build_dataset
from gpubalance.cli import main

SMALL = ["--families", "weighted-skew,sticky-skew", "--count", "1", "--duration", "300"]


def _train(out: Path, seed: int = 1) -> dict:
    assert (
        main(["analyzer", "train", *SMALL, "--seed", str(seed), "--jobs", "1", "--out", str(out)])
        == 0
    )
    return json.loads(out.with_suffix(".report.json").read_text())


def test_the_same_seed_gives_the_same_model_and_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _train(tmp_path / "a.skops", seed=2)
    second = _train(tmp_path / "b.skops", seed=2)
    printed = capsys.readouterr()
    assert "state macro-F1" in printed.out and str(tmp_path / "b.skops") in printed.out
    assert printed.err == ""  # no progress bar in a pipe
    assert first["held_out"] == second["held_out"]
    a, b = model.load(tmp_path / "a.skops"), model.load(tmp_path / "b.skops")
    table = build_dataset(generated_examples(["slow-card"], 1, 5, 300), workers=1).table
    assert np.array_equal(a.predict_proba(table), b.predict_proba(table))
    assert list(a.classes_) == list(b.classes_)
    # the report says what the model was trained on
    data = first["data"]
    assert data["families_drawn"] == ["weighted-skew", "sticky-skew"]
    assert data["variants_per_family"] == 1 and data["generator_seed"] == 2
    assert set(data["families"]) == {"weighted-skew", "sticky-skew"}
    assert data["windows"] == sum(data["labels"].values()) > 0
    assert set(first["held_out"]["per_family"]) == {"weighted-skew", "sticky-skew"}
    confusion = first["held_out"]["confusion"]
    assert len(confusion["matrix"]) == len(confusion["labels"])
    assert {"scikit-learn", "skops", "numpy", "gpubalance"} <= set(first["versions"])
    assert "commit" in first and first["params"]["random_state"] == 2
    assert first["format"] == model.FORMAT


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--families", "no-such-family"], "unknown family 'no-such-family'"),
        (["--count", "0"], "expected an integer of 1 or more"),
        (["--seed", "-1"], "expected an integer of 0 or more"),
        (["--duration", "nan"], "expected a number of seconds above 0"),
    ],
)
def test_bad_options_are_named(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["analyzer", "train", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("hours", ["-1", "nan", "many"])
def test_a_bad_soak_is_named(hours: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["analyzer", "evaluate", "--soak-hours", hours])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--soak-hours" in err and "expected a number of hours, 0 or more" in err


def test_too_little_data_is_said_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # one 60-s run: two windows per GPU, too few for the trees
    args = ["--families", "balanced-pool", "--count", "1", "--duration", "60", "--seed", "3"]
    assert main(["analyzer", "train", *args, "--jobs", "1", "--out", str(tmp_path / "m")]) == 1
    assert "raise --count or --duration" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_a_terminal_gets_a_progress_bar(tmp_path: Path) -> None:
    out = tmp_path / "m.skops"
    command = [sys.executable, "-m", "gpubalance", "analyzer", "train", *SMALL]
    ran = run_on_terminal([*command, "--jobs", "1", "--out", str(out)], timeout=240)
    assert ran.returncode == 0
    for stage in (b"running scenarios", b"held-out folds and final fit"):
        assert stage in ran.shown, ran.shown
    assert b"state macro-F1" in ran.stdout
    assert out.is_file()
