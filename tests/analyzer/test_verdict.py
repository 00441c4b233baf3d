"""Verdicts: persistence and hysteresis, unknown with its reason, evidence, fleet verdicts."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from analyzer_harness import healthy_frame

from gpubalance.analyzer.baselines import QueueUtilization, UtilizationThreshold
from gpubalance.analyzer.features import FeatureBuilder, FeatureTable
from gpubalance.analyzer.frames import frames_from_samples
from gpubalance.analyzer.verdict import Diagnosis, Verdicts, idle_while_queued_ratio
from gpubalance.diagnosis import Verdict
from gpubalance.lab import run as lab_run
from gpubalance.lab import scenario
from gpubalance.lab.fast import ORIGIN_SECONDS
from gpubalance.telemetry import GpuSample, Sample

WINDOW = 30.0


_frame = healthy_frame


def _states(verdicts: tuple[Verdict, ...], gpu: int = 0) -> list[str]:
    return [v.state for v in verdicts if v.gpu == gpu]


def _by_utilization(utilization: list[float], **options: object) -> Diagnosis:
    """One GPU, one window per utilization, judged by the utilization-threshold rule."""
    table = FeatureBuilder().transform(
        _frame(0, i, utilization_mean_ratio=u) for i, u in enumerate(utilization)
    )
    return Verdicts(UtilizationThreshold().fit(table), **options).diagnose(table)  # type: ignore[arg-type]


# persistence and hysteresis


def test_a_one_window_blip_does_not_flip_a_verdict() -> None:
    verdicts = _by_utilization([0.97, 0.97, 0.6, 0.97, 0.97]).verdicts
    assert _states(verdicts) == ["overloaded"] * 5
    blip = verdicts[2]
    assert "the classifier says balanced/none" in " ".join(blip.evidence)
    assert "1 of 2 windows to change" in " ".join(blip.evidence)
    assert blip.confidence < 0.01  # the held state, as probable as the classifier finds it


def test_a_sustained_change_flips_after_k_windows() -> None:
    utilization = [0.97, 0.97, 0.6, 0.6, 0.6, 0.6]
    assert _states(_by_utilization(utilization).verdicts) == [
        "overloaded",
        "overloaded",
        "overloaded",
        "balanced",
        "balanced",
        "balanced",
    ]
    three = _by_utilization(utilization, persistence_windows=3).verdicts
    assert _states(three)[:5] == ["overloaded"] * 4 + ["balanced"]
    one = _by_utilization(utilization, persistence_windows=1).verdicts
    assert _states(one)[:3] == ["overloaded", "overloaded", "balanced"]


class _Answers:
    """A classifier that answers a given label per row, each with probability 0.9."""

    def __init__(self, labels: list[str]) -> None:
        self.labels = labels
        self.classes_ = np.array(sorted(set(labels)))

    def predict_proba(self, table: FeatureTable) -> np.ndarray:
        out = np.full((len(table.frames), len(self.classes_)), 0.1 / (len(self.classes_) - 1))
        for row, label in enumerate(self.labels):
            out[row, self.classes_.tolist().index(label)] = 0.9
        return out


def test_a_change_of_state_counts_its_windows_whatever_cause_each_gives() -> None:
    busy = {"utilization_mean_ratio": 1.0, "queue_depth_mean": 20.0}
    table = FeatureBuilder().transform([_frame(0, 0)] + [_frame(0, w, **busy) for w in (1, 2, 3)])
    says = [
        "balanced/none",
        "overloaded/capacity_shortage",
        "overloaded/routing_skew",
        "overloaded/routing_skew",
    ]
    verdicts = Verdicts(_Answers(says)).diagnose(table).verdicts
    # two windows in a row say overloaded: it is, with the latest window's cause
    assert [(v.state, v.cause) for v in verdicts] == [
        ("balanced", "none"),
        ("balanced", "none"),
        ("overloaded", "routing_skew"),
        ("overloaded", "routing_skew"),
    ]
    # a held state's cause changes only when two windows in a row name the same new one
    flips = ["overloaded/routing_skew", "overloaded/capacity_shortage"] * 2
    table = FeatureBuilder().transform([_frame(0, w, **busy) for w in range(4)])
    held = Verdicts(_Answers(flips)).diagnose(table).verdicts
    assert {(v.state, v.cause) for v in held} == {("overloaded", "routing_skew")}


def test_the_first_window_takes_the_classifier_answer() -> None:
    assert _states(_by_utilization([0.6, 0.97, 0.97, 0.97]).verdicts) == [
        "balanced",
        "balanced",
        "overloaded",
        "overloaded",
    ]


def test_hysteresis_pairs_hold_a_state_inside_the_band() -> None:
    # p(overloaded) = logistic((u - 0.9) / 0.05): 0.45 at 89 %, 0.55 at 91 %, 0.35 at 87 %,
    # 0.27 at 85 %
    held = _by_utilization([0.97] + [0.89] * 5).verdicts
    assert _states(held) == ["overloaded"] * 6  # 0.45 is not below the leave bar of 0.3
    assert "short of 0.60 to enter it while overloaded holds" in " ".join(held[-1].evidence)
    assert _states(_by_utilization([0.6] + [0.91] * 5).verdicts) == ["balanced"] * 6
    assert _states(_by_utilization([0.97] + [0.87] * 3).verdicts) == ["overloaded"] * 4
    assert _states(_by_utilization([0.97] + [0.85] * 3).verdicts) == [
        "overloaded",
        "overloaded",
        "balanced",
        "balanced",
    ]
    # one threshold instead of a pair: 0.45 / 0.55 flip it
    flat = _by_utilization([0.97] + [0.89] * 3, enter_confidence=0.5, leave_confidence=0.5)
    assert _states(flat.verdicts) == ["overloaded", "overloaded", "balanced", "balanced"]


class _Split:
    """Starved at first (0.9); from the third window on starved 0.04 and the rest split
    between balanced and overloaded: no successor reaches the entering bar. ``alternate``: the
    likelier of the two changes every window."""

    classes_ = np.array(["balanced/none", "overloaded/routing_skew", "starved/routing_skew"])

    def __init__(self, alternate: bool = False) -> None:
        self.alternate = alternate

    def predict_proba(self, table: FeatureTable) -> np.ndarray:
        out = np.tile([0.50, 0.46, 0.04], (len(table.frames), 1))
        if self.alternate:
            out[1::2] = [0.46, 0.50, 0.04]
        out[:2] = [0.05, 0.05, 0.90]
        return out


def test_a_held_state_all_but_gone_is_left_for_the_likeliest() -> None:
    # as the live demo showed it: GPUs starved by a skew held starved at 0.04 after the
    # controller fixed the skew, while the classifier split the rest between the other two
    table = FeatureBuilder().transform(_frame(0, w) for w in range(6))
    verdicts = Verdicts(_Split()).diagnose(table).verdicts
    assert _states(verdicts) == ["starved"] * 3 + ["balanced"] * 3
    assert "1 of 2 windows to change" in " ".join(verdicts[2].evidence)
    # the two others taking turns as the likelier: the windows that leave it count together,
    # the latest names the state, and the hysteresis holds that one
    turns = Verdicts(_Split(alternate=True)).diagnose(table).verdicts
    assert _states(turns) == ["starved"] * 3 + ["overloaded"] * 3
    # without the abandon bar the hysteresis holds it for good
    held = Verdicts(_Split(), abandon_confidence=0.0).diagnose(table).verdicts
    assert _states(held) == ["starved"] * 6
    assert "short of 0.60 to enter it while starved holds (0.04" in " ".join(held[-1].evidence)


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="leave_confidence <= enter_confidence"):
        _by_utilization([0.5], enter_confidence=0.3, leave_confidence=0.6)
    with pytest.raises(ValueError, match="abandon_confidence <= leave_confidence"):
        _by_utilization([0.5], abandon_confidence=0.35)
    with pytest.raises(ValueError, match="persistence_windows must be 1 or more"):
        _by_utilization([0.5], persistence_windows=0)


# rules before and after the classifier


def test_a_gpu_with_no_traffic_is_not_host_bound() -> None:
    pinned = {"utilization_mean_ratio": 0.05, "feeder_cpu_cores_max": 1.0, "batch_size_mean": 1.0}
    idle = {"completions_per_second": 0.0, "queue_depth_max": 0.0, "running_mean": 0.0}
    table = FeatureBuilder().transform([_frame(0, 0, **pinned), _frame(1, 0, **pinned, **idle)])
    rule = QueueUtilization().fit(table)
    assert rule.predict(table).tolist() == ["starved/host_bound", "starved/host_bound"]
    working, empty = Verdicts(rule).diagnose(table).verdicts
    assert (working.state, working.cause) == ("starved", "host_bound")
    assert (empty.state, empty.cause) == ("starved", "low_demand")
    assert "feeding process at 1.00 cores (pinned)" in working.evidence


class _Says:
    """A classifier that answers one label for every row (a learned model could)."""

    def __init__(self, label: str) -> None:
        self.classes_ = np.array(["balanced/none", label])

    def predict_proba(self, table: FeatureTable) -> np.ndarray:
        return np.tile([0.1, 0.9], (len(table.frames), 1))


def test_a_gpu_at_full_clock_without_a_slowdown_reason_is_not_throttling() -> None:
    busy = {"utilization_mean_ratio": 1.0, "queue_depth_mean": 20.0}
    table = FeatureBuilder().transform(
        [
            _frame(0, 0, **busy),
            _frame(
                1,
                0,
                **busy,
                sm_clock_ratio=0.5,
                throttled_ratio=1.0,
                throttle_reasons=frozenset({"sw_thermal_slowdown"}),
            ),
        ]
    )
    full, slowed = Verdicts(_Says("overloaded/throttling")).diagnose(table).verdicts
    assert (full.state, full.cause) == ("overloaded", "routing_skew")
    assert (slowed.state, slowed.cause) == ("overloaded", "throttling")
    assert slowed.evidence[0] == "SM clock 50 % of max (sw_thermal_slowdown)"


def test_a_gpu_whose_worker_is_gone_is_starved_by_a_crash() -> None:
    gone = {
        "serving_queues": 0,
        "queue_names": (),
        "service_classes": (),
        "utilization_mean_ratio": 0.0,
        "queue_depth_mean": None,
        "queue_depth_max": None,
        "running_mean": None,
        "batch_size_mean": None,
        "completions_per_second": None,
    }
    frames = [_frame(0, 0), _frame(0, 1, **gone), _frame(0, 2, **gone), _frame(0, 3)]
    table = FeatureBuilder().transform(frames)
    verdicts = Verdicts(_Says("balanced/none")).diagnose(table).verdicts
    assert [(v.state, v.cause) for v in verdicts] == [
        ("balanced", "none"),
        ("starved", "worker_crash"),
        ("starved", "worker_crash"),
        ("starved", "worker_crash"),  # back: persistence holds the crash one window more
    ]
    assert verdicts[1].evidence[0] == (
        "no serving queue of pool llama reports from GPU 0: its worker is down"
    )
    # a GPU that never served a pool is not a crash: the classifier judges it
    idle = FeatureBuilder().transform([_frame(0, 0, **gone), _frame(0, 1, **gone)])
    assert {v.cause for v in Verdicts(_Says("balanced/none")).diagnose(idle).verdicts} == {"none"}


def _fast(name: str, seconds: float, out: Path) -> list[Sample]:
    samples: list[Sample] = []
    lab_run.run(scenario.load(name), "fast", seconds, 1, out, on_sample=samples.append)
    return samples


def _diagnose(samples: list[Sample], classifier: str = "queue") -> tuple[FeatureTable, Diagnosis]:
    frames = frames_from_samples(
        samples, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
    )
    table = FeatureBuilder().transform(frames)
    rule = QueueUtilization() if classifier == "queue" else UtilizationThreshold()
    return table, Verdicts(rule.fit(table)).diagnose(table)


def _at(diagnosis: Diagnosis, seconds: float, gpu: int) -> Verdict:
    return next(
        v for v in diagnosis.verdicts if v.t_start == ORIGIN_SECONDS + seconds and v.gpu == gpu
    )


@pytest.fixture(scope="module")
def skewed(tmp_path_factory: pytest.TempPathFactory) -> list[Sample]:
    return _fast("skewed-heterogeneous", 240, tmp_path_factory.mktemp("skewed"))


def _edit(
    samples: list[Sample], start: float, end: float, change: Callable[[Sample], Sample | None]
) -> list[Sample]:
    """The samples with those in (start, end] seconds after the origin changed or dropped."""
    out = []
    for sample in samples:
        if start < sample.timestamp_seconds - ORIGIN_SECONDS <= end:
            edited = change(sample)
            if edited is not None:
                out.append(edited)
        else:
            out.append(sample)
    return out


def _gpus(sample: Sample, change: Callable[[GpuSample], GpuSample | None]) -> Sample:
    gpus = tuple(g for g in (change(g) for g in sample.gpus) if g is not None)
    return dataclasses.replace(sample, gpus=gpus)


def test_a_hung_nvml_call_is_unknown_with_the_call(skewed: list[Sample]) -> None:
    def stuck(gpu: GpuSample) -> GpuSample:
        if gpu.index != 1:
            return gpu
        # what the exporter serves for a GPU whose read missed its deadline: no figures
        return GpuSample(
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.name,
            stale=True,
            stale_call="nvmlDeviceGetPowerUsage",
        )

    _, diagnosis = _diagnose(_edit(skewed, 60, 90, lambda s: _gpus(s, stuck)))
    hung = _at(diagnosis, 60, 1)
    assert hung.state == "unknown" and hung.confidence == 1.0
    assert hung.unknown_reason == "NVML call hung in nvmlDeviceGetPowerUsage"
    assert "30 of 30 samples stale" in hung.evidence[0]
    assert _at(diagnosis, 60, 0).state == "overloaded"  # the others keep their verdicts
    assert _at(diagnosis, 90, 1).state == "starved"  # and it is judged again once it answers


def test_a_lost_gpu_is_unknown_never_idle(tmp_path: Path) -> None:
    _, diagnosis = _diagnose(_fast("gpu-lost", 240, tmp_path))
    after = [v for v in diagnosis.verdicts if v.gpu == 2 and v.t_end > ORIGIN_SECONDS + 150]
    assert after and {(v.state, v.unknown_reason) for v in after} == {("unknown", "GPU lost")}
    assert _at(diagnosis, 90, 2).state != "unknown"  # the sample at 150 s closes 120-150


def test_a_gap_in_the_source_is_unknown_for_its_length(skewed: list[Sample]) -> None:
    _, diagnosis = _diagnose(_edit(skewed, 60, 120, lambda s: None))
    for gpu in range(4):
        assert _at(diagnosis, 60, gpu).unknown_reason == "no samples for 30 s"
        assert _at(diagnosis, 90, gpu).unknown_reason == "no samples for 60 s"
        assert _at(diagnosis, 120, gpu).state != "unknown"
    assert [v.t_start - ORIGIN_SECONDS for v in diagnosis.verdicts if v.gpu == 0] == [
        0,
        30,
        60,
        90,
        120,
        150,
        180,
        210,
    ]


def test_a_gpu_that_comes_and_goes_mid_window(skewed: list[Sample]) -> None:
    def without_3(sample: Sample) -> Sample:
        return _gpus(sample, lambda g: None if g.index == 3 else g)

    # GPU 3 falls off at 100 s (10 of the window's 30 samples) and is back at 200 s
    _, diagnosis = _diagnose(_edit(skewed, 100, 200, without_3))
    assert _at(diagnosis, 90, 3).unknown_reason == "only 10 of 30 expected samples"
    assert _at(diagnosis, 120, 3).unknown_reason == "no samples for 30 s"
    assert _at(diagnosis, 150, 3).unknown_reason == "no samples for 60 s"
    # it answered for the last 10 s of this window: too little to judge
    assert _at(diagnosis, 180, 3).unknown_reason == "only 10 of 30 expected samples"
    assert _at(diagnosis, 210, 3).state == "starved"


def test_a_missing_figure_is_unknown_with_what_is_missing(skewed: list[Sample]) -> None:
    def no_utilization(gpu: GpuSample) -> GpuSample:
        if gpu.index != 2:
            return gpu
        return dataclasses.replace(gpu, utilization_ratio=None, utilization_samples=())

    _, diagnosis = _diagnose(_edit(skewed, 90, 120, lambda s: _gpus(s, no_utilization)))
    blind = _at(diagnosis, 90, 2)
    assert blind.state == "unknown"
    assert blind.unknown_reason == "the classifier cannot judge: no utilization reading"


def test_an_empty_table_gives_no_verdicts() -> None:
    table = FeatureBuilder().transform([])
    assert Verdicts(QueueUtilization().fit(table)).diagnose(table) == Diagnosis((), ())


# evidence


def test_every_verdict_carries_evidence_with_its_figures(skewed: list[Sample]) -> None:
    table, diagnosis = _diagnose(skewed)
    frames = {(f.t_start, f.gpu): f for f in table.frames}
    assert len(diagnosis.verdicts) == len(table.frames)
    for verdict in diagnosis.verdicts:
        assert verdict.evidence and all(s.strip() for s in verdict.evidence)
        frame = frames[(verdict.t_start, verdict.gpu)]
        queue, utilization = frame.queue_depth_mean, frame.utilization_mean_ratio
        assert queue is not None and utilization is not None
        shown = f"{queue:.0f}" if queue >= 10 else f"{queue:.1f}"
        assert f"queue {shown} vs peer median" in verdict.evidence[0]
        assert f"utilization {utilization * 100:.0f} % vs" in verdict.evidence[0]
    starved = [v for v in diagnosis.verdicts if v.state == "starved"]
    assert any("idle" in s and "while a peer had" in s for v in starved for s in v.evidence)


def test_routing_evidence_says_the_work_against_the_busiest_peer_and_the_pool(
    skewed: list[Sample],
) -> None:
    # what tells routing_skew from low_demand and capacity_shortage (the causes' routing
    # lines): the GPU's work, its busiest peer's, and the pool's split by capacity
    table, diagnosis = _diagnose(skewed)
    rows = {(f.t_start, f.gpu): table.row(i) for i, f in enumerate(table.frames)}
    said = 0
    for verdict in diagnosis.verdicts:
        row = rows[(verdict.t_start, verdict.gpu)]
        work = [s for s in verdict.evidence if s.startswith("its work would keep it busy")]
        if verdict.cause not in {"routing_skew", "low_demand", "capacity_shortage"}:
            assert not work
            continue
        rho, peer, fair = (
            row[name]
            for name in ("rho_fitted_ratio", "peer_rho_fitted_max", "pool_fair_rho_fitted_ratio")
        )
        assert np.isfinite([rho, peer, fair]).all()
        assert work == [
            f"its work would keep it busy {rho * 100:.0f} % of the window at full batches, its "
            f"busiest peer's {peer * 100:.0f} %; the pool's, split by capacity, "
            f"{fair * 100:.0f} % each"
        ]
        # said after the load, before the rest
        assert verdict.evidence.index(work[0]) == 1
        said += 1
    assert said == len(diagnosis.verdicts)
    # the last window: the default target's work is past its window, the others' busiest
    # peer is it, and split by capacity the pool's work would leave every GPU room
    last = {
        v.gpu: rows[(v.t_start, v.gpu)]
        for v in diagnosis.verdicts
        if v.t_start == 210 + ORIGIN_SECONDS
    }
    assert last[0]["rho_fitted_ratio"] >= 1.0
    assert all(last[g]["peer_rho_fitted_max"] == last[0]["rho_fitted_ratio"] for g in (1, 2, 3))
    assert last[0]["pool_fair_rho_fitted_ratio"] < 0.85


def test_throttling_and_host_evidence_name_their_figures(tmp_path: Path) -> None:
    table, diagnosis = _diagnose(_fast("thermal-throttle", 240, tmp_path / "t"))
    frame = next(f for f in table.frames if f.gpu == 1 and f.t_start == ORIGIN_SECONDS + 210)
    assert frame.sm_clock_ratio is not None
    throttled = _at(diagnosis, 210, 1)
    assert (throttled.state, throttled.cause) == ("overloaded", "throttling")
    reasons = ", ".join(sorted(frame.throttle_reasons))
    assert (
        throttled.evidence[0] == f"SM clock {frame.sm_clock_ratio * 100:.0f} % of max ({reasons})"
    )
    # the work against the pool's tells the routing causes apart, not this one
    assert not any(s.startswith("its work would keep it busy") for s in throttled.evidence)

    table, diagnosis = _diagnose(_fast("host-bound", 240, tmp_path / "h"))
    frame = next(f for f in table.frames if f.gpu == 2 and f.t_start == ORIGIN_SECONDS + 210)
    assert frame.feeder_cpu_cores_max is not None
    sentence = f"feeding process at {frame.feeder_cpu_cores_max:.2f} cores (pinned)"
    assert sentence in _at(diagnosis, 210, 2).evidence


# fleet verdicts and idle while queued


def test_idle_while_queued_is_unused_capacity_beside_a_queue() -> None:
    frames = [
        # GPU 0: two full batches of 8 waiting, busy all the window
        _frame(0, 0, utilization_mean_ratio=1.0, queue_depth_mean=16.0, batch_size_mean=8.0),
        # GPU 1: busy half the window with batches of 2 of 8: 1/8 of its capacity used
        _frame(1, 0, utilization_mean_ratio=0.5, queue_depth_mean=0.0, batch_size_mean=2.0),
    ]
    table = FeatureBuilder().transform(frames)
    (fleet,) = Verdicts(QueueUtilization().fit(table)).diagnose(table).fleet
    assert fleet.idle_while_queued_ratio == pytest.approx((0 + (1 - 0.5 * 2 / 8)) / 2)
    assert idle_while_queued_ratio(table) == pytest.approx(fleet.idle_while_queued_ratio)
    assert fleet.kind == "imbalance"
    # nothing waits at any worker (one central queue): nothing idles beside a queue
    calm = FeatureBuilder().transform(
        [_frame(g, 0, utilization_mean_ratio=0.3, queue_depth_mean=0.0) for g in range(4)]
    )
    assert idle_while_queued_ratio(calm) == 0.0


def test_more_than_half_unknown_makes_the_pool_unknown() -> None:
    table = FeatureBuilder().transform(
        [_frame(0, 0)] + [_frame(g, 0, sample_count=5) for g in (1, 2)]
    )
    (fleet,) = Verdicts(QueueUtilization().fit(table)).diagnose(table).fleet
    assert fleet.kind == "unknown" and fleet.gpus == (0, 1, 2)
    assert "GPUs 1, 2 of 3 unknown: only 5 of 30 expected samples" in fleet.evidence[0]


def _kinds(diagnosis: Diagnosis) -> Counter[str]:
    return Counter(f.kind for f in diagnosis.fleet)


def test_a_skewed_server_is_an_imbalance_that_idles_beside_its_queue(
    skewed: list[Sample],
) -> None:
    table, diagnosis = _diagnose(skewed)
    assert _kinds(diagnosis) == {"imbalance": len(diagnosis.fleet)}
    ratio = idle_while_queued_ratio(table)
    assert ratio is not None and ratio > 0.2
    assert all((f.idle_while_queued_ratio or 0) > 0.2 for f in diagnosis.fleet)
    assert "move work" in " ".join(diagnosis.fleet[-1].evidence)


def test_one_pooled_queue_does_not_idle_beside_a_queue(tmp_path: Path) -> None:
    table, diagnosis = _diagnose(_fast("balanced-4x4090", 300, tmp_path))
    ratio = idle_while_queued_ratio(table)
    assert ratio is not None and ratio < 0.05
    kinds = _kinds(diagnosis)
    assert kinds["balanced"] >= 0.9 * len(diagnosis.fleet)


def test_capacity_shortage_at_the_peak(tmp_path: Path) -> None:
    _, diagnosis = _diagnose(_fast("capacity-shortage", 360, tmp_path))
    peak = [f for f in diagnosis.fleet if 240 <= f.t_start - ORIGIN_SECONDS <= 330]
    assert {f.kind for f in peak} == {"capacity_shortage"}
    assert "scale out" in " ".join(peak[0].evidence)
    assert diagnosis.fleet[0].kind == "balanced"  # the ramp starts at ~65 % of capacity


def test_an_overprovisioned_fleet_is_told_to_scale_in(tmp_path: Path) -> None:
    _, diagnosis = _diagnose(_fast("overprovisioned-fleet", 600, tmp_path))
    kinds = _kinds(diagnosis)
    assert kinds.most_common(1)[0][0] == "over_provisioning"
    assert not kinds["imbalance"] and not kinds["capacity_shortage"]
