"""The evaluation: held-out verdicts, detection delay, false alarms and the report."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gpubalance.analyzer import evaluate
from gpubalance.analyzer.evaluate import OURS, RunVerdicts


def _run(
    truth: list[str], said: list[str], events: tuple[int, ...] = (), family: str = "slow-card"
) -> RunVerdicts:
    """One GPU's windows 0..n-1 (short names: B balanced, S starved, O overloaded)."""
    names = {"B": "balanced/none", "S": "starved/low_demand", "O": "overloaded/slow_card"}
    return RunVerdicts(
        family=family,
        name=f"{family}-1-000",
        window_seconds=30.0,
        event_windows=events,
        keys=tuple(("host", 0, w) for w in range(len(truth))),
        truth=tuple(names[x] for x in truth),
        said={evaluate.OURS: tuple(names[x] for x in said)},
    )


def test_delay_counts_windows_from_the_truths_change_to_the_verdicts() -> None:
    # event in window 3; the truth turns overloaded in window 4; the verdict follows in 6
    run = _run(list("BBBBOOOOO"), list("BBBBBBOOO"), events=(3,))
    assert evaluate.detection_delays(run, evaluate.OURS) == [2]


def test_a_change_the_verdict_never_names_is_missed() -> None:
    run = _run(list("BBBOOBBB"), list("BBBBBBBB"), events=(3,))
    assert evaluate.detection_delays(run, evaluate.OURS) == [None]


def test_the_median_delay_counts_the_misses() -> None:
    seen = _run(list("BBBOOOO"), list("BBBBOOO"), events=(3,))
    missed = _run(list("BBBOOOO"), list("BBBBBBB"), events=(3,))
    assert evaluate.summary([seen, missed, missed], evaluate.OURS)["median_delay_windows"] == (
        float("inf")
    )
    figures = evaluate.summary([seen, seen, missed], evaluate.OURS)
    assert figures["median_delay_windows"] == 1.0 and figures["missed"] == 1


def test_a_change_far_from_any_event_is_not_the_events() -> None:
    truth = ["B"] * (evaluate.EVENT_REACH_WINDOWS + 3) + ["O", "O"]
    run = _run(truth, truth, events=(1,))
    assert evaluate.detection_delays(run, evaluate.OURS) == []


def test_false_alarms_count_stretches_over_balanced_gpu_time() -> None:
    run = _run(list("BBBBBBBBOO"), list("BOOBBSBBOO"), family="balanced-pool")
    alarms, days = evaluate.false_alarms(run, evaluate.OURS)
    assert alarms == 2  # windows 1-2 are one alarm, window 5 another; 8-9 are truly overloaded
    assert days == pytest.approx(8 * 30 / 86_400)
    figures = evaluate.summary([run], evaluate.OURS)
    assert figures["false_alarms_per_gpu_day"] == pytest.approx(2 / days)
    # a run not written to be balanced does not count towards the alarm rate
    other = evaluate.summary([_run(list("BBBB"), list("BOOB"))], evaluate.OURS)
    assert other["false_alarms_per_gpu_day"] is None


def test_an_alarm_the_truth_bears_out_nearby_is_not_false() -> None:
    # overloaded in windows 2-4: the verdict names it a window late and holds it a window
    # after the truth moved on (the window-level scores count those two windows against it)
    late = _run(list("BBOOOBBBB"), list("BBBOOOBBB"), family="balanced-pool")
    assert evaluate.false_alarms(late, evaluate.OURS)[0] == 0
    # two windows early is not near: nothing overloaded within one window of window 1 ...
    early = _run(list("BBBBOOBBB"), list("BOBBOOBBB"), family="balanced-pool")
    assert evaluate.false_alarms(early, evaluate.OURS)[0] == 1
    # ... and the state must be the truth's: starved where it was overloaded is false
    wrong = _run(list("BBOOOBBBB"), list("BBSSSBBBB"), family="balanced-pool")
    assert evaluate.false_alarms(wrong, evaluate.OURS)[0] == 1
    # an alarm that changes state mid-way is two alarms, each judged on its own
    split = _run(list("BBOOBBBBB"), list("BBOOSSBBB"), family="balanced-pool")
    assert evaluate.false_alarms(split, evaluate.OURS)[0] == 1


def test_scores_are_of_the_verdicts() -> None:
    run = _run(list("BBOO"), list("BBOO"))
    assert evaluate.summary([run], evaluate.OURS)["state_macro_f1"] == 1.0
    wrong = _run(list("BBOO"), list("BBBB"))
    assert evaluate.summary([wrong], evaluate.OURS)["state_macro_f1"] < 1.0


def test_the_truth_one_window_late_says_each_gpus_window_before() -> None:
    keys = [("h", 0, 3), ("h", 1, 3), ("h", 0, 4), ("h", 1, 4), ("h", 0, 6)]
    truth = ["balanced/none", "starved/low_demand", "overloaded/slow_card", "balanced/none", "x"]
    # a GPU's first window, and one after a gap, keep their own truth
    assert evaluate.late_labels(keys, truth) == (
        "balanced/none",
        "starved/low_demand",
        "balanced/none",
        "starved/low_demand",
        "x",
    )


def test_the_false_alarm_rate_bound_is_the_exact_poisson_one() -> None:
    # chi-square quantiles: chi2.ppf(0.95, 2k + 2) / 2 for k = 0, 1, 5
    for count, bound in ((0, 2.9957), (1, 4.7439), (5, 10.5130)):
        assert evaluate.rate_upper_bound(count, 1.0) == pytest.approx(bound, abs=1e-3)
    assert evaluate.rate_upper_bound(0, 3.0) < 1.0  # 3 GPU-days without an alarm show <= 1
    assert evaluate.rate_upper_bound(0, 2.9) > 1.0


def test_the_soak_is_later_variants_until_the_gpu_time_asked() -> None:
    assert evaluate.soak_examples(8, 1, 0.0) == []
    soak = evaluate.soak_examples(8, 1, 10.0, 600.0)
    judged = {e.name for e in evaluate.generated_examples([evaluate.SOAK_FAMILY], 8, 1)}
    assert soak and not {e.name.removeprefix("soak-") for e in soak} & judged
    gpus = [sum(g.get("count", 1) for g in e.document["hardware"]["gpus"]) for e in soak]
    hours = [n * 600 / 3600 for n in gpus]
    assert sum(hours) >= 10.0 > sum(hours[:-1])  # stops at the first run that reaches it
    assert {e.duration_seconds for e in soak} == {600.0}


def test_fewer_training_variants_than_judged_ones_are_refused() -> None:
    with pytest.raises(ValueError, match="train_count 1 must be at least count 2"):
        evaluate.evaluate(["balanced-pool"], 2, 1, train_count=1)


def test_an_unknown_family_is_named() -> None:
    with pytest.raises(ValueError, match="no-such-family"):
        evaluate.family_list("balanced-pool,no-such-family")
    assert evaluate.family_list("slow-card, batch-wait") == ["slow-card", "batch-wait"]


def test_the_report_holds_every_figure_beside_the_baselines(tmp_path: Path) -> None:
    report = tmp_path / "EVALUATION.md"
    report.write_text(
        "# kept\n\n<!-- eval:gentd:start -->\nGenTD figures\n<!-- eval:gentd:end -->\n"
    )
    result = evaluate.evaluate(
        ["balanced-pool", "weighted-skew"],
        1,
        1,
        duration_seconds=300,
        shipped=False,
        soak_gpu_hours=0.5,
        soak_run_seconds=300,
        jobs=1,
        make=lambda: evaluate.GpuStateClassifier(max_iter=20),
        train_count=2,
    )
    # every held-out window was judged by each classifier, by the fold that held it out: the
    # first variant of each family (count 1), where two of each trained the folds
    assert {r.family for r in result.generated} == {"balanced-pool", "weighted-skew"}
    assert {r.name for r in result.generated} == {
        e.name for e in evaluate.generated_examples(["balanced-pool", "weighted-skew"], 1, 1)
    }
    assert result.data["runs"] == 4
    for run in result.generated:
        assert set(run.said) == {*evaluate.JUDGES, evaluate.RAW, evaluate.LATE}
        assert run.said[evaluate.LATE] == evaluate.late_labels(run.keys, run.truth)
        assert all(len(labels) == len(run.truth) for labels in run.said.values())
    # balanced runs past the judged ones, until their GPU-time reaches what was asked
    assert result.soak and {r.family for r in result.soak} == {evaluate.SOAK_FAMILY}
    soak_hours = sum(len(r.truth) for r in result.soak) * 30 / 3600  # windows of 30 s
    assert 0.4 < soak_hours < 0.5 + 8 * 300 / 3600  # the last run is whole (at most 8 GPUs)
    assert not {r.name for r in result.soak} & {r.name for r in result.generated}
    for run in result.soak:
        assert set(run.said) == {*evaluate.JUDGES, evaluate.RAW, evaluate.LATE}
    both = evaluate.summary(result.generated, evaluate.OURS, result.soak)
    alone = evaluate.summary(result.generated, evaluate.OURS)
    assert both["balanced_gpu_days"] > alone["balanced_gpu_days"]
    # the lab applied what was recommended, if anything, and measured it
    assert "unavailable" not in result.recommendations, result.recommendations
    evaluate.write_report(result, report, "gpubalance analyzer evaluate --count 1")
    text = report.read_text()
    assert "GenTD figures" in text  # the other section is kept
    for needle in (
        "state macro-F1",
        "cause accuracy",
        "median delay",
        "false alarms / GPU-day",
        evaluate.QUEUE,
        evaluate.THRESHOLD,
        evaluate.LATE,
        "`weighted-skew`",
        "evaluation-confusion.png",
        "Recommendation prediction error",
        "## False alarms over more balanced GPU-time",
    ):
        assert needle in text
    # the error taken apart, where the lab applied something
    assert ("What the error is made of" in text) == bool(result.recommendations["parts"])
    # and where: one row per family and action, its GPUs adding up to the errors' count
    cells = result.recommendations["cells"]
    assert ("Per family and action" in text) == bool(cells)
    for (family, action), (count, median, largest) in cells.items():
        assert f"| `{family}` | {action} | {count} |" in text
        assert 0 <= median <= largest
    assert (tmp_path / "evaluation-confusion.png").stat().st_size > 0
    assert (tmp_path / "evaluation-families.png").stat().st_size > 0
    # written again, the section is replaced, not repeated
    evaluate.write_report(result, report, "gpubalance analyzer evaluate --count 1")
    assert report.read_text().count("## Held-out families") == 1


def test_a_windows_distance_is_from_the_nearer_of_the_truths_lines() -> None:
    assert evaluate.line_distance(0.33) == pytest.approx(0.10)
    assert evaluate.line_distance(0.27) == pytest.approx(0.10)
    assert evaluate.line_distance(0.85 * 0.8) == pytest.approx(0.20)
    assert evaluate.line_distance(0.50) == pytest.approx((0.85 - 0.50) / 0.85)


def test_the_scores_by_distance_put_each_window_in_its_band() -> None:
    # windows 0-1 near the starved line, the verdict wrong on one; 2-3 far from both, right
    run = dataclasses.replace(_run(list("SBSB"), list("BBSB")), truth_rho=(0.29, 0.31, 0.05, 0.55))
    bands = {label: (count, f1) for label, count, f1 in evaluate.by_line_distance([run], [OURS])}
    assert bands["within 10 %"][0] == 2
    assert bands["within 10 %"][1][OURS] < 1.0
    assert bands["beyond 25 %"] == (2, {OURS: 1.0})
    assert bands["10-25 %"] == (0, {OURS: None})
    # a run that kept no ρ is left out
    assert (
        sum(n for _, n, _ in evaluate.by_line_distance([_run(list("SB"), list("SB"))], [OURS])) == 0
    )


def test_a_false_alarm_says_how_near_its_line_the_truth_was() -> None:
    # a balanced run: an overloaded stretch (windows 2-3) the truth never names, at ρ 0.80
    # and 0.78; a starved one (window 6) at ρ 0.36
    run = dataclasses.replace(
        _run(list("BBBBBBBB"), list("BBOOBBSB"), family="balanced-pool"),
        truth_rho=(0.5, 0.5, 0.80, 0.78, 0.5, 0.5, 0.36, 0.5),
    )
    assert evaluate.false_alarms(run, OURS)[0] == 2
    assert evaluate.false_alarm_rhos([run], OURS) == pytest.approx(
        sorted([(0.85 - 0.80) / 0.85, (0.36 - 0.30) / 0.30])
    )
