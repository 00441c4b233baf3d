"""Recommendations: typed actions on persisted verdicts, cheapest first, with what they do."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from analyzer_harness import WINDOW, healthy_frame

from gpubalance.analyzer.baselines import QueueUtilization
from gpubalance.analyzer.features import FeatureBuilder, FeatureTable
from gpubalance.analyzer.frames import GpuFrame, frames_from_samples
from gpubalance.analyzer.recommend import Recommender
from gpubalance.analyzer.verdict import Verdicts
from gpubalance.diagnosis import Recommendation
from gpubalance.lab import run as lab_run
from gpubalance.lab import scenario
from gpubalance.lab.fast import ORIGIN_SECONDS
from gpubalance.telemetry import Sample


def _lab(name: str, seconds: float, out: Path) -> list[Sample]:
    samples: list[Sample] = []
    lab_run.run(scenario.load(name), "fast", seconds, 1, out, on_sample=samples.append)
    return samples


def _recommend(
    samples: list[Sample], until: float, recommender: Recommender | None = None
) -> tuple[Recommendation, ...]:
    kept = [s for s in samples if s.timestamp_seconds - ORIGIN_SECONDS <= until]
    frames = frames_from_samples(
        kept, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
    )
    table = FeatureBuilder().transform(frames)
    diagnosis = Verdicts(QueueUtilization().fit(table)).diagnose(table)
    return (recommender or Recommender()).recommend(diagnosis, table, ORIGIN_SECONDS + until)


def _actions(found: tuple[Recommendation, ...]) -> list[tuple[str, str]]:
    return [(r.action, r.target) for r in found]


@pytest.fixture(scope="module")
def default_target(tmp_path_factory: pytest.TempPathFactory) -> list[Sample]:
    return _lab("default-target", 210, tmp_path_factory.mktemp("default-target"))


def _shares(recommendation: Recommendation) -> dict[str, float]:
    """The pool's share per GPU ("gpu:N") a set_weights gives, summed over its workers."""
    weights = recommendation.parameters["weights"]
    assert isinstance(weights, list)
    out: dict[str, float] = {}
    for item in weights:
        out[f"gpu:{item['gpu']}"] = out.get(f"gpu:{item['gpu']}", 0.0) + item["weight"]
    return out


def test_a_balanced_pool_gets_nothing(tmp_path: Path) -> None:
    assert _recommend(_lab("balanced-4x4090", 240, tmp_path), 240) == ()


def test_a_default_target_is_reweighted_by_capacity(default_target: list[Sample]) -> None:
    found = _recommend(default_target, 210)
    assert _actions(found) == [("set_weights", "pool:qwen2.5-7b")]
    weights = found[0]
    assert weights.cost_rank == 0
    # four identical cards: equal weights, one per GPU's worker (the router's server names),
    # and every GPU at the pool's ρ after
    assert [(w["gpu"], w["worker"]) for w in weights.parameters["weights"]] == [
        (g, f"w{g}") for g in range(4)
    ]
    assert _shares(weights) == pytest.approx({f"gpu:{g}": 0.25 for g in range(4)}, abs=0.01)
    expected = weights.expected
    assert expected is not None
    assert (
        expected.rho_before[0] > 1.2 and max(expected.rho_before.values()) == expected.rho_before[0]
    )
    after = list(expected.rho_after.values())
    assert max(after) - min(after) < 0.01 and 0.35 < after[0] < 0.6
    assert expected.capacity_source == {0: "saturated", 1: "peers", 2: "peers", 3: "peers"}
    # GPU 0's backlog drains first, then nothing idles beside a queue
    before, after_iwq = expected.idle_while_queued_before, expected.idle_while_queued_after
    assert before is not None and after_iwq is not None and 0 < after_iwq < before
    assert any(e.startswith("GPU 0 overloaded/routing_skew since") for e in weights.evidence)
    assert "GPU 0 gets more work than its capacity" in weights.reason


def test_the_same_situation_keeps_its_id(default_target: list[Sample]) -> None:
    earlier, later = _recommend(default_target, 180), _recommend(default_target, 210)
    assert [r.id for r in earlier] == [r.id for r in later]
    assert earlier[0].created_seconds == later[0].created_seconds < ORIGIN_SECONDS + 180
    assert later[0].expires_seconds == ORIGIN_SECONDS + 210 + Recommender().ttl_seconds
    # each rests on the newest window it saw: what an executor's staleness counts from
    assert (earlier[0].observed_seconds, later[0].observed_seconds) == (
        ORIGIN_SECONDS + 180,
        ORIGIN_SECONDS + 210,
    )


def test_a_reweighting_rests_on_one_window_other_actions_on_two(
    default_target: list[Sample], tmp_path: Path
) -> None:
    # the cheapest change, bounded, verified and undone by the controller, comes first
    reweight = [("set_weights", "pool:qwen2.5-7b")]
    assert _actions(_recommend(default_target, 30)) == reweight
    assert _recommend(default_target, 30, Recommender(reweight_windows=2)) == ()
    assert _actions(_recommend(default_target, 60, Recommender(reweight_windows=2))) == reweight
    assert _recommend(default_target, 60, Recommender(reweight_windows=3)) == ()
    # taking a worker away waits for the verdicts to persist (and, by default, for 8 windows
    # of demand to judge its peak on: here 2)
    idle = _lab("overprovisioned-fleet", 60, tmp_path)
    assert _recommend(idle, 30, Recommender(scale_in_windows=1)) == ()
    # its eight 4090s are priced alike from their card's batch times: the last of them goes
    assert _actions(_recommend(idle, 60, Recommender(scale_in_windows=2))) == [
        ("remove_worker", "gpu:6")
    ]
    assert _recommend(idle, 60, Recommender(persistence_windows=3, scale_in_windows=2)) == ()


def test_a_shortage_is_scaled_out_not_reweighted(tmp_path: Path) -> None:
    found = _recommend(_lab("capacity-shortage", 330, tmp_path), 330)
    assert [r.action for r in found] == ["scale_out"]
    scale = found[0]
    assert scale.parameters["card"] == "NVIDIA GeForce RTX 4090"
    count = scale.parameters["gpus"]
    assert isinstance(count, int) and count >= 1
    assert scale.expected is not None
    assert min(scale.expected.rho_before.values()) >= 1.0
    # the new GPUs take the host's next indices, and the pool lands near the target
    assert set(scale.expected.rho_after) == set(range(4 + count))
    assert max(scale.expected.rho_after.values()) <= Recommender().target_rho + 0.05


def test_a_lost_gpu_is_drained(tmp_path: Path) -> None:
    lost = _lab("gpu-lost", 270, tmp_path)
    assert _recommend(lost, 210) == ()  # lost in the window before: not yet persisted
    found = _recommend(lost, 270)
    assert _actions(found) == [("drain", "gpu:2")]
    assert "GPU 2 is lost" in found[0].reason


def test_a_throttled_card_is_weighted_down_and_its_host_looked_at(tmp_path: Path) -> None:
    found = _recommend(_lab("thermal-throttle", 270, tmp_path), 270)
    assert _actions(found) == [("set_weights", "pool:llama-3.1-8b"), ("investigate_host", "gpu:1")]
    weights = _shares(found[0])
    assert weights["gpu:1"] == min(weights.values())
    assert found[1].parameters["cause"] == "throttling" and found[1].expected is None


# rules on hand-made windows


class _Labels:
    """A classifier that gives each GPU a fixed label (a learned model could)."""

    def __init__(self, labels: dict[int, str]) -> None:
        self.labels = labels
        self.classes_ = np.array(sorted(set(labels.values())))

    def predict_proba(self, table: FeatureTable) -> np.ndarray:
        out = np.zeros((len(table.frames), len(self.classes_)))
        for i, frame in enumerate(table.frames):
            out[i, list(self.classes_).index(self.labels[frame.gpu])] = 1.0
        return out


def _by_labels(frames: list[GpuFrame], labels: dict[int, str]) -> tuple[Recommendation, ...]:
    table = FeatureBuilder().transform(frames)
    diagnosis = Verdicts(_Labels(labels)).diagnose(table)
    return Recommender().recommend(diagnosis, table, frames[-1].t_end)


def _one_hot(
    gpu_0: dict[str, object], gpu_1: dict[str, object], gpu_2: dict[str, object] | None = None
) -> list[GpuFrame]:
    """Four windows of three GPUs: GPU 0 busy, queue growing, serving 10/s; 1 and 2 at 1/s."""
    frames = []
    for w in range(4):
        frames += [
            healthy_frame(
                0,
                w,
                utilization_mean_ratio=1.0,
                queue_depth_mean=40.0,
                batch_size_mean=8.0,
                completions_per_second=10.0,
                queue_depth_slope_per_second=0.5,
                **gpu_0,
            ),
            healthy_frame(1, w, completions_per_second=1.0, **gpu_1),
            healthy_frame(2, w, **({"completions_per_second": 1.0} | (gpu_2 or {}))),
        ]
    return frames


def _lost_and_back(windows: int, lost: int = 2, **settings: float) -> tuple[Recommendation, ...]:
    """Three quiet GPUs; GPU 1 lost (NVML says so) in windows 1 .. ``lost``, back after."""
    frames = [
        healthy_frame(
            g, w, workers=(f"w{g}",), completions_per_second=1.0, lost=g == 1 and 1 <= w <= lost
        )
        for w in range(windows)
        for g in range(3)
    ]
    table = FeatureBuilder().transform(frames)
    diagnosis = Verdicts(_Labels(dict.fromkeys(range(3), "starved/low_demand"))).diagnose(table)
    return Recommender(**settings).recommend(diagnosis, table, frames[-1].t_end)


def _crashed(windows: int) -> tuple[Recommendation, ...]:
    """Three quiet GPUs; GPU 1's worker gone (no serving queue reports) from window 1 on."""
    frames = [
        healthy_frame(g, w, workers=(f"w{g}",), completions_per_second=1.0)
        if g != 1 or w == 0
        else healthy_frame(g, w, serving_queues=0, completions_per_second=None)
        for w in range(windows)
        for g in range(3)
    ]
    table = FeatureBuilder().transform(frames)
    diagnosis = Verdicts(_Labels(dict.fromkeys(range(3), "starved/low_demand"))).diagnose(table)
    assert diagnosis.verdicts[-2].cause == "worker_crash"
    return Recommender().recommend(diagnosis, table, frames[-1].t_end)


def test_a_lost_gpu_is_drained_and_returned_once_back_and_a_crashed_worker_left_to_haproxy() -> (
    None
):
    # lost in windows 1 and 2 (drained after the second), back from window 3, which returns it
    assert _actions(_lost_and_back(3)) == [("drain", "gpu:1")]
    back = _lost_and_back(4)
    assert _actions(back) == [("add_worker", "gpu:1")]
    assert back[0].parameters["workers"] == ["w1"]
    assert "GPU 1 was lost until 90" in back[0].reason
    # while a drain renewed in its last lost window may stand (ttl 120 s), and no longer
    assert _actions(_lost_and_back(7)) == [("add_worker", "gpu:1")]
    assert _actions(_lost_and_back(8)) == []
    assert _actions(_lost_and_back(7, ttl_seconds=60.0)) == []
    # lost for one window only: never drained, nothing to return
    assert _actions(_lost_and_back(5, lost=1)) == []
    # a crashed worker's server fails HAProxy's health check, which brings it back with the
    # worker: a drain would keep the restarted worker out
    assert _actions(_crashed(4)) == []


def test_a_host_bound_gpu_gets_no_more_work_and_its_host_looked_at() -> None:
    # GPU 1's host is under CPU pressure, its feeding process not pinned at its threads
    frames = _one_hot({}, {"feeder_cpu_cores_max": 0.7})
    labels = {0: "overloaded/routing_skew", 1: "starved/host_bound", 2: "starved/routing_skew"}
    found = _by_labels(frames, labels)
    assert _actions(found) == [("set_weights", "pool:llama"), ("investigate_host", "gpu:1")]
    weights = _shares(found[0])
    # GPU 1 keeps its share of the pool's offered load (1 of 12.5/s), the rest by capacity
    assert weights["gpu:1"] == pytest.approx(1.0 / 12.5, abs=0.01)
    assert weights["gpu:0"] == pytest.approx(weights["gpu:2"])
    assert "feeding process" in found[1].reason or "CPU" in found[1].reason
    # pinned at its one thread: its requests wait for it, and it gets 70 % of its share
    pinned = _shares(_by_labels(_one_hot({}, {"feeder_cpu_cores_max": 1.0}), labels)[0])
    assert pinned["gpu:1"] == pytest.approx(0.7 / 12.5, abs=0.01)


def _host_pinned(room: bool) -> tuple[Recommendation, ...]:
    """Three GPUs, each sent 4/s; GPU 0's feeding process pinned at its one thread (its GPU
    half idle); the others half busy (``room``), or serving flat out with their queues full."""
    busy = {"utilization_mean_ratio": 1.0, "queue_depth_mean": 8.0, "batch_size_mean": 8.0}
    frames = []
    for w in range(4):
        frames += [
            healthy_frame(
                0, w, workers=("w0",), completions_per_second=4.0, feeder_cpu_cores_max=1.0
            ),
            *(
                healthy_frame(
                    g, w, workers=(f"w{g}",), completions_per_second=4.0, **({} if room else busy)
                )
                for g in (1, 2)
            ),
        ]
    labels = {0: "starved/host_bound", 1: "balanced/none", 2: "balanced/none"}
    return _by_labels(frames, labels)


def test_a_gpu_whose_feeder_is_pinned_sheds_work_to_peers_with_room() -> None:
    """No peer is overloaded, and leastconn sends the pinned worker as many requests in flight
    as the others: they wait for its one thread. It gets 70 % of what it serves."""
    found = _host_pinned(room=True)
    assert _actions(found) == [("set_weights", "pool:llama"), ("investigate_host", "gpu:0")]
    shares = _shares(found[0])
    assert shares["gpu:0"] == pytest.approx(0.7 * 4.0 / 12.0, abs=0.01)
    assert shares["gpu:1"] == pytest.approx(shares["gpu:2"])
    assert "pinned" in found[0].reason and "GPU 0" in found[0].reason
    # peers serving flat out already (4/s is all they can): nowhere to send its work
    assert _actions(_host_pinned(room=False)) == [("investigate_host", "gpu:0")]


def test_an_overloaded_gpu_short_of_memory_still_sheds_work() -> None:
    # GPU 0 is held back by its memory: more work would not help it, but less does
    frames = _one_hot({"memory_used_bytes": 23 * 2**30}, {})
    found = _by_labels(
        frames,
        {0: "overloaded/memory_pressure", 1: "starved/routing_skew", 2: "starved/routing_skew"},
    )
    assert _actions(found)[0] == ("set_weights", "pool:llama")
    weights = _shares(found[0])
    # it is offered more than it serves (10 of 12/s and a growing queue): its share shrinks,
    # never grows, and the others split what it sheds alike
    assert weights["gpu:0"] < 10.0 / 12.0 - 0.1
    assert weights["gpu:1"] == pytest.approx(weights["gpu:2"])
    expected = found[0].expected
    assert expected is not None and expected.rho_after[0] < expected.rho_before[0]


def test_a_card_whose_capacity_is_a_guess_is_trusted_with_twice_its_share_at_most() -> None:
    # GPU 2, an RTX 3090, ran batches of 1 at a tenth busy: what it would serve in full
    # batches is extrapolated (its card's prior), here above the 4090s' measured 10/s
    slow = {
        "card": "NVIDIA GeForce RTX 3090",
        "completions_per_second": 0.5,
        "batch_size_mean": 1.0,
        "utilization_mean_ratio": 0.1,
    }
    frames = _one_hot({}, {}, slow)
    labels = {0: "overloaded/routing_skew", 1: "starved/routing_skew", 2: "starved/routing_skew"}
    found = _by_labels(frames, labels)
    assert _actions(found) == [("set_weights", "pool:llama")]
    expected = found[0].expected
    assert expected is not None and expected.capacity_source[2] in ("prior", "busy_rate")
    assert expected.capacity_per_second[2] > expected.capacity_per_second[1]
    # it gets at most half an even share (twice its 4 % now is less), the measured GPUs the
    # rest by capacity
    shares = _shares(found[0])
    assert shares["gpu:2"] == pytest.approx(0.5 / 3, abs=0.001)
    assert shares["gpu:0"] == pytest.approx(shares["gpu:1"], abs=0.001)
    assert max(expected.rho_after.values()) < expected.rho_before[0]


def test_no_weights_rest_on_an_unmeasured_capacity() -> None:
    # GPU 0 busy all the time with nothing queued: what it could serve is not measured
    frames = [
        healthy_frame(
            g,
            w,
            utilization_mean_ratio=1.0 if g == 0 else 0.1,
            completions_per_second=8.0 if g == 0 else 1.0,
        )
        for w in range(3)
        for g in range(2)
    ]
    assert _by_labels(frames, {0: "overloaded/routing_skew", 1: "starved/routing_skew"}) == ()


def test_a_slow_batcher_is_told_to_stop_waiting() -> None:
    frames = [healthy_frame(0, w, batch_delay_seconds=1.5) for w in range(3)]
    found = _by_labels(frames, {0: "starved/batch_delay"})
    assert _actions(found) == [("tune_batching", "gpu:0")]
    assert found[0].parameters["max_queue_delay_seconds"] == 0.0


def _mixed(share: float | None, classes: dict[int, tuple[str, ...]]) -> tuple[Recommendation, ...]:
    frames = [
        healthy_frame(
            g,
            w,
            utilization_mean_ratio=1.0,
            queue_depth_mean=40.0,
            batch_size_mean=8.0,
            completions_per_second=4.0,
            service_classes=classes[g],
            slow_class_work_share=share if len(classes[g]) > 1 else None,
            workers=(f"w{g}",),
        )
        for w in range(3)
        for g in classes
    ]
    return _by_labels(frames, dict.fromkeys(classes, "overloaded/class_interference"))


def _split(share: float | None, classes: dict[int, tuple[str, ...]]) -> Recommendation:
    return next(r for r in _mixed(share, classes) if r.action == "split_pools")


def test_interactive_behind_batch_work_is_split_out() -> None:
    split = _split(None, dict.fromkeys(range(4), ("batch", "interactive")))
    # no class's share of the work is measured: half and half, every GPU at the pool's ρ
    assert split.parameters["batch_gpus"] == [0, 1]
    assert split.parameters["interactive_gpus"] == [2, 3]
    assert split.expected is not None
    assert len(set(split.expected.rho_after.values())) == 1


def test_a_split_gives_the_batch_class_gpus_by_its_share_of_the_work() -> None:
    both = ("batch", "interactive")
    # batch work a quarter of four alike GPUs' work: one GPU serves it, three the rest
    split = _split(0.25, dict.fromkeys(range(4), both))
    assert split.parameters["batch_gpus"] == [0]
    assert split.parameters["interactive_gpus"] == [1, 2, 3]
    expected = split.expected
    assert expected is not None
    after = expected.rho_after
    assert after[0] == pytest.approx(after[1]) == pytest.approx(after[3])
    assert after[0] == pytest.approx(sum(expected.rho_before.values()) / 4, rel=0.01)
    # the controller finds the backends by the workers of each side
    assert split.parameters["batch_workers"] == ["w0"]
    assert split.parameters["interactive_workers"] == ["w1", "w2", "w3"]
    # three quarters: the other way round
    split = _split(0.75, dict.fromkeys(range(4), both))
    assert split.parameters["batch_gpus"] == [0, 1, 2]
    # a GPU whose queues serve one class is no part of the shared queue: it keeps its work
    split = _split(0.5, {0: both, 1: both, 2: both, 3: ("premium",)})
    assert 3 not in split.parameters["batch_gpus"] + split.parameters["interactive_gpus"]
    assert split.parameters["batch_gpus"] == [0]  # of three alike: the side nearer half
    assert split.expected is not None
    assert split.expected.rho_after[3] == pytest.approx(split.expected.rho_before[3])


def test_a_pool_whose_gpus_serve_its_classes_apart_is_not_split_again() -> None:
    """After a split the verdicts lag: GPUs still judged for the interference of the windows
    before it, while each serves one class now. No split is asked of those."""
    apart = {0: ("batch",), 1: ("interactive",), 2: ("interactive",), 3: ("interactive",)}
    assert [r for r in _mixed(0.25, apart) if r.action == "split_pools"] == []
    # one GPU still serving both (a split's first windows) is not a pool to split either
    assert [
        r for r in _mixed(0.25, {**apart, 1: ("batch", "interactive")}) if r.action == "split_pools"
    ] == []
    # a pool whose queues report no classes (as from a server without class queues) still is
    assert _split(None, dict.fromkeys(range(4), ())).parameters["batch_gpus"] == [0, 1]


def test_bad_settings_are_named() -> None:
    table = FeatureBuilder().transform([healthy_frame(0, 0)])
    diagnosis = Verdicts(QueueUtilization().fit(table)).diagnose(table)
    with pytest.raises(ValueError, match="persistence_windows"):
        Recommender(persistence_windows=0).recommend(diagnosis, table, 30.0)
    with pytest.raises(ValueError, match="target_rho"):
        Recommender(target_rho=1.5).recommend(diagnosis, table, 30.0)
    with pytest.raises(ValueError, match="scale_in_windows"):
        Recommender(scale_in_windows=0).recommend(diagnosis, table, 30.0)


def test_peers_the_routing_starves_reweight_a_gpu_not_yet_judged_overloaded() -> None:
    # GPU 0 takes most of the work, its queue still building: judged balanced so far, while
    # its two peers idle for want of work the routing sends elsewhere
    frames = []
    for w in range(3):
        frames += [
            healthy_frame(
                0,
                w,
                utilization_mean_ratio=1.0,
                queue_depth_mean=20.0,
                batch_size_mean=8.0,
                completions_per_second=10.0,
                queue_depth_slope_per_second=0.5,
            ),
            healthy_frame(1, w, utilization_mean_ratio=0.1, completions_per_second=1.0),
            healthy_frame(2, w, utilization_mean_ratio=0.1, completions_per_second=1.0),
        ]
    labels = {0: "balanced/none", 1: "starved/routing_skew", 2: "starved/routing_skew"}
    found = _by_labels(frames, labels)
    assert _actions(found) == [("set_weights", "pool:llama")]
    weights = _shares(found[0])
    assert weights["gpu:0"] == pytest.approx(weights["gpu:1"], rel=0.05)
    # starved for want of demand, not for the routing: nothing to re-weight
    idle = {0: "balanced/none", 1: "starved/low_demand", 2: "starved/low_demand"}
    assert _by_labels(frames, idle) == ()


# -- moves between pools ------------------------------------------------------------------------


def _two_pools(windows: int = 3, quiet_rate: float = 1.0, busy: bool = True) -> list[GpuFrame]:
    """GPUs 0-1 serve llama, saturated with a growing queue (10.5/s offered, 10/s served) when
    ``busy``; GPUs 2-3 serve qwen at a fifth of their busy rate, GPU 3 a little more."""
    frames = []
    for w in range(windows):
        for g in (0, 1):
            figures: dict[str, object] = (
                dict(
                    utilization_mean_ratio=1.0,
                    queue_depth_mean=20.0,
                    batch_size_mean=8.0,
                    completions_per_second=10.0,
                    queue_depth_slope_per_second=0.5,
                )
                if busy
                else {}
            )
            frames.append(healthy_frame(g, w, workers=(f"w{g}",), **figures))
        for g in (2, 3):
            rate = quiet_rate * (1.2 if g == 3 else 1.0)
            frames.append(
                healthy_frame(
                    g,
                    w,
                    workers=(f"w{g}",),
                    queue_names=("qwen",),
                    utilization_mean_ratio=0.2 * rate,
                    completions_per_second=rate,
                )
            )
    return frames


LABELS = {0: "overloaded/capacity_shortage", 1: "overloaded/capacity_shortage"} | {
    2: "starved/low_demand",
    3: "starved/low_demand",
}


def _moves(found: tuple[Recommendation, ...]) -> list[Recommendation]:
    return [r for r in found if r.action == "move_worker"]


def test_a_quiet_pools_least_loaded_gpu_moves_to_the_busy_pool() -> None:
    moves = _moves(_by_labels(_two_pools(), LABELS))
    assert [(m.target, m.parameters["to"]) for m in moves] == [("gpu:2", "llama")]
    move = moves[0]
    assert move.cost_rank == 5
    assert move.parameters["gpu"] == 2 and move.parameters["pool"] == "qwen"
    assert move.parameters["workers"] == ["w2"]
    assert move.parameters["to_workers"] == ["w0", "w1"]
    expected = move.expected
    assert expected is not None
    # llama: 21/s offered over two GPUs of 10/s, then three; qwen: 2.2/s over 2 GPUs of 5/s
    # (their busy rate), then GPU 3 alone
    assert expected.rho_before == pytest.approx({0: 1.05, 1: 1.05, 2: 0.22, 3: 0.22})
    assert expected.rho_after == pytest.approx({0: 0.7, 1: 0.7, 2: 0.7, 3: 0.44})
    assert expected.capacity_per_second[2] == pytest.approx(10.0)
    assert "move GPU 2 to llama" in move.reason
    # the same situation, the same id; the way back is another recommendation
    assert _moves(_by_labels(_two_pools(4), LABELS))[0].id == move.id


def test_a_quiet_pool_a_busy_one_takes_a_gpu_from_is_not_also_scaled_in() -> None:
    # qwen is over-provisioned (both GPUs starved for want of demand): alone, it would give up
    # a GPU; beside a busy llama the GPU goes to llama instead
    def of_qwen(found: tuple[Recommendation, ...]) -> list[tuple[str, str]]:
        return [(r.action, r.target) for r in found if r.parameters["pool"] == "qwen"]

    assert of_qwen(_by_labels(_two_pools(), LABELS)) == [("move_worker", "gpu:2")]
    idle = LABELS | {0: "balanced/none", 1: "balanced/none"}
    # (a scale-in judges the busiest of the last 8 windows: fewer, and it waits)
    assert ("remove_worker", "gpu:3") in of_qwen(_by_labels(_two_pools(8, busy=False), idle))
    assert of_qwen(_by_labels(_two_pools(7, busy=False), idle)) == []


def test_no_move_leaves_the_quiet_pool_busier_than_the_busy_one_was_or_without_a_gpu() -> None:
    # qwen at ρ 0.55 would be at 1.1 on one GPU, above llama's 1.05 now: the move would only
    # move the overload
    assert _moves(_by_labels(_two_pools(quiet_rate=2.5), LABELS)) == []
    # a quiet pool of one GPU keeps it
    alone = [f for f in _two_pools() if f.gpu != 3]
    assert _moves(_by_labels(alone, LABELS)) == []


def test_no_move_without_a_busy_pool_or_when_the_load_outlasts_the_prediction() -> None:
    calm = dict.fromkeys(range(4), "balanced/none")
    assert _moves(_by_labels(_two_pools(busy=False), calm)) == []
    frames = _two_pools()
    table = FeatureBuilder().transform(frames)
    diagnosis = Verdicts(_Labels(LABELS)).diagnose(table)
    slow = Recommender(move_load_seconds=120.0, ttl_seconds=120.0)
    assert _moves(slow.recommend(diagnosis, table, frames[-1].t_end)) == []
    assert _moves(Recommender().recommend(diagnosis, table, frames[-1].t_end))


def test_a_busy_pool_takes_a_gpu_before_its_verdict_has_held() -> None:
    """llama's load and queue say it needs a GPU in every window, but its GPUs were judged
    balanced until the verdict step turned them overloaded in the latest window: the move
    rests on the load, not on a verdict the rising queue has only just turned. qwen, which
    gives the GPU, is judged on verdicts that have held."""

    class Turning(_Labels):
        """``early`` before window ``turn``, LABELS from it on."""

        def __init__(self, early: dict[int, str], turn: int) -> None:
            super().__init__(early)
            self.classes_ = np.array(sorted({*early.values(), *LABELS.values()}))
            self.turn = turn

        def predict_proba(self, table: FeatureTable) -> np.ndarray:
            out = np.zeros((len(table.frames), len(self.classes_)))
            for i, frame in enumerate(table.frames):
                late = frame.t_start >= self.turn * WINDOW
                label = (LABELS if late else self.labels)[frame.gpu]
                out[i, list(self.classes_).index(label)] = 1.0
            return out

    frames = _two_pools(4)
    table = FeatureBuilder().transform(frames)
    calm_llama = LABELS | {0: "balanced/none", 1: "balanced/none"}
    for turn in (2, 3):
        diagnosis = Verdicts(Turning(calm_llama, turn)).diagnose(table)
        last = {v.gpu: v.state for v in diagnosis.verdicts if v.t_start == 3 * WINDOW}
        # turned in window 2, the verdict step has held it since window 3; in window 3, not yet
        assert last[0] == last[1] == ("overloaded" if turn == 2 else "balanced")
        found = Recommender().recommend(diagnosis, table, frames[-1].t_end)
        assert [(m.target, m.parameters["to"]) for m in _moves(found)] == [("gpu:2", "llama")]
    # a quiet pool whose verdicts turned in the latest window gives nothing
    calm_qwen = LABELS | {2: "balanced/none", 3: "balanced/none"}
    diagnosis = Verdicts(Turning(calm_qwen, 2)).diagnose(table)
    last = {v.gpu: v.state for v in diagnosis.verdicts if v.t_start == 3 * WINDOW}
    assert last[2] == last[3] == "starved"
    assert _moves(Recommender().recommend(diagnosis, table, frames[-1].t_end)) == []


def test_no_move_to_a_pool_whose_short_batches_leave_it_room() -> None:
    """llama's GPUs run batches of 2.5 and 4.5 with half the larger waiting (a pool after a
    quiet spell: each batch 0.2 s plus 0.1 s per request), served 12.5/s and offered 13.5/s.
    At the batches run that is ρ 1.08 and qwen's GPU 2 is wanted; but with a configured limit
    of 16 the same GPUs serve 8.9/s each at full batches, ρ 0.76: more load grows llama's
    batches before it needs a GPU."""

    def short(limit: float | None) -> list[GpuFrame]:
        frames = []
        for f in _two_pools():
            if f.gpu in (0, 1):
                size = 2.5 if f.gpu == 0 else 4.5
                f = dataclasses.replace(
                    f,
                    batch_size_mean=size,
                    queue_depth_mean=3.0,
                    completions_per_second=size / (0.2 + 0.1 * size),
                    max_batch_size=limit,
                )
            frames.append(f)
        return frames

    moves = _moves(_by_labels(short(None), LABELS))
    assert [(m.target, m.parameters["to"]) for m in moves] == [("gpu:2", "llama")]
    assert _moves(_by_labels(short(4.5), LABELS)) == moves
    assert _moves(_by_labels(short(16.0), LABELS)) == []


def test_no_move_at_a_pool_a_gpu_joined_within_the_persistence_windows() -> None:
    def joined(windows_in_qwen: int) -> list[GpuFrame]:
        """_two_pools over 4 windows, and GPU 4 moved from llama to qwen that many ago."""
        frames = _two_pools(4)
        for w in range(4):
            pool = ("qwen",) if w >= 4 - windows_in_qwen else ("llama",)
            frames.append(
                healthy_frame(
                    4,
                    w,
                    workers=("w4",),
                    queue_names=pool,
                    utilization_mean_ratio=0.2,
                    completions_per_second=1.0,
                )
            )
        return frames

    labels = LABELS | {4: "starved/low_demand"}
    # qwen's new shape seen for one window, then two: too few to plan a second move on
    assert _moves(_by_labels(joined(1), labels)) == []
    assert _moves(_by_labels(joined(2), labels)) == []
    # three (persistence 2, and one more): settled, and the least loaded qwen GPU may go
    assert [m.target for m in _moves(_by_labels(joined(3), labels))] == ["gpu:2"]

    # a GPU judged held back by its host while its new model loaded: its pool gets nothing
    # until its new shape has held the persistence windows and one more
    held = LABELS | {4: "starved/host_bound"}
    for windows in (1, 2):
        assert not [r for r in _by_labels(joined(windows), held) if r.parameters["pool"] == "qwen"]
    assert ("investigate_host", "gpu:4") in _actions(_by_labels(joined(3), held))


def _wave(tmp_path: Path, seconds: float) -> list[Sample]:
    """Four RTX 4090s under demand that peaks at 0 s (about 38 requests/s in the first
    windows), ebbs to nothing at 240 s and peaks again at 480 s."""
    text = """
name: wave
description: "demand that ebbs and comes back"
duration_seconds: 480
seed: 3
hardware:
  gpus:
    - {card: RTX 4090, count: 4}
models:
  llama-3.1-8b:
    params_billions: 8.03
    kv_bytes_per_token: 131072
workers:
  - gpu: all
    model: llama-3.1-8b
    max_batch_size: 16
    max_queue_delay_ms: 10
router:
  policy: least_connections
traffic:
  - name: chat
    class: interactive
    arrivals: {kind: diurnal, mean_rate: 20, amplitude: 1.0, period_seconds: 480}
    prompt_tokens: {kind: fixed, value: 256}
    output_tokens: {kind: fixed, value: 32}
"""
    path = tmp_path / "wave.yaml"
    path.write_text(text)
    samples: list[Sample] = []
    lab_run.run(
        scenario.load(str(path)), "fast", seconds, 1, tmp_path / "run", on_sample=samples.append
    )
    return samples


def test_a_lull_between_peaks_is_not_scaled_in(tmp_path: Path) -> None:
    samples = _wave(tmp_path, 330)
    # at 300 s every GPU has been starved for want of demand for two windows; three GPUs
    # would serve the last two windows' load, not the 32 requests/s of 60-90 s
    lull = _recommend(samples, 300, Recommender(scale_in_windows=2))
    assert [r.action for r in lull] == ["remove_worker"]
    assert "busiest of the last 2 windows" in lull[0].reason
    assert _recommend(samples, 300) == ()
    # and the demand comes back: 30 s later the pool serves twice what it did in the lull
    kept = [s for s in samples if s.timestamp_seconds - ORIGIN_SECONDS <= 330]
    frames = frames_from_samples(
        kept, window_seconds=WINDOW, interval_seconds=1.0, origin=ORIGIN_SECONDS
    )
    offered: dict[float, float] = {}
    for frame in frames:
        offered[frame.t_start] = offered.get(frame.t_start, 0.0) + (
            frame.completions_per_second or 0.0
        )
    rates = [offered[t] for t in sorted(offered)]
    assert rates[-1] > 2 * max(rates[-3:-1])


def test_each_host_of_a_fleet_gets_what_it_would_alone() -> None:
    # two hosts in one table, as a fleet read from Prometheus comes: the recommender reads it
    # one host at a time, and each host's recommendations are those of its rows alone
    frames = [dataclasses.replace(f, host="a") for f in _two_pools(4)] + [
        dataclasses.replace(f, host="b") for f in _two_pools(4, quiet_rate=3.0)
    ]
    table = FeatureBuilder().transform(frames)

    def recommend(part: FeatureTable) -> tuple[Recommendation, ...]:
        diagnosis = Verdicts(_Labels(LABELS)).diagnose(part)
        return Recommender().recommend(diagnosis, part, frames[-1].t_end)

    together = recommend(table)
    alone = [
        r
        for host in ("b", "a")
        for r in recommend(table.take([i for i, f in enumerate(table.frames) if f.host == host]))
    ]
    assert {r.host for r in together} == {"a", "b"}
    assert {r.action for r in together} >= {"move_worker"}
    assert list(together) == sorted(alone, key=lambda r: (r.cost_rank, r.host, r.target, r.id))
