"""Causes the figures name directly: read off lab runs of each mechanism, and decisive in the
model's answers where they fire."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from gpubalance.analyzer import causes
from gpubalance.analyzer.features import COLUMNS, FeatureBuilder, FeatureTable
from gpubalance.analyzer.frames import frames_from_samples
from gpubalance.analyzer.model import GpuStateClassifier
from gpubalance.analyzer.train import Example, build_dataset, truth_of_features
from gpubalance.analyzer.verdict import Verdicts
from gpubalance.lab import generate, scenario
from gpubalance.lab import run as lab_run
from gpubalance.lab.fast import ORIGIN_SECONDS
from gpubalance.telemetry import Sample


def _table(name: str, seconds: float, out: Path) -> FeatureTable:
    samples: list[Sample] = []
    lab_run.run(scenario.load(name), "fast", seconds, 1, out, on_sample=samples.append)
    frames = frames_from_samples(
        samples, window_seconds=30.0, interval_seconds=1.0, origin=ORIGIN_SECONDS
    )
    return FeatureBuilder().transform(frames)


def _after(table: FeatureTable, seconds: float, gpus: set[int]) -> list[int]:
    return [
        i
        for i, f in enumerate(table.frames)
        if f.gpu in gpus and f.t_start >= ORIGIN_SECONDS + seconds
    ]


def test_a_batcher_that_idles_the_gpu_names_batch_delay(tmp_path: Path) -> None:
    # batches of 32 with 2 s of queue delay at 5 req/s: the GPU waits most of each cycle
    table = _table("batch-delay", 240, tmp_path)
    share = causes.batch_idle_share(table)
    assert min(share) >= causes.BATCH_IDLE_SHARE
    assert set(causes.named(table).starved) == {"batch_delay"}


@pytest.fixture(scope="module")
def io_bound(tmp_path_factory: pytest.TempPathFactory) -> FeatureTable:
    return _table("io-bound", 240, tmp_path_factory.mktemp("io"))  # 100 MB/s from 120 s


def test_io_pressure_names_io_bound_after_the_disk_slows(io_bound: FeatureTable) -> None:
    named = causes.named(io_bound).starved
    assert {named[i] for i in _after(io_bound, 120, {0, 1, 2, 3})} == {"io_bound"}
    assert "io_bound" not in {named[i] for i, f in enumerate(io_bound.frames) if f.t_start < 90}


def test_a_named_cause_takes_its_states_whole_probability(io_bound: FeatureTable) -> None:
    rows = _after(io_bound, 120, {0, 1, 2, 3})
    table = FeatureTable(tuple(io_bound.frames[i] for i in rows), io_bound.values[rows])
    classes = np.asarray(
        ["balanced/none", "starved/io_bound", "starved/low_demand", "overloaded/routing_skew"]
    )
    learned = np.tile([0.2, 0.1, 0.6, 0.1], (len(rows), 1))
    expected = np.tile([0.2, 0.7, 0.0, 0.1], (len(rows), 1))
    assert np.allclose(causes.apply(learned, classes, table), expected)
    # a cause the classes do not hold leaves the learned answer as it is
    two = learned[:, [0, 2]]
    assert causes.apply(two, classes[[0, 2]], table).tolist() == two.tolist()


def test_a_gpu_waiting_for_its_batches_is_starved_by_them(tmp_path: Path) -> None:
    waiting = _table("batch-delay", 120, tmp_path)
    classes = np.asarray(["balanced/none", "starved/batch_delay", "starved/low_demand"])
    learned = np.tile([0.7, 0.1, 0.2], (len(waiting.frames), 1))
    moved = np.tile([0.0, 1.0, 0.0], (len(waiting.frames), 1))
    assert np.allclose(causes.apply(learned, classes, waiting), moved)


def test_a_gpu_whose_batches_fill_as_it_waits_is_not_starved_by_them() -> None:
    # the batch-delay server with batches of 8 at 10 req/s: a batch fills within the 2 s and
    # the GPU idles over half of each cycle, yet its work at full batches keeps it busy over
    # 30 % of the window: balanced by its truth, and the batcher does not name the state
    document = yaml.safe_load(scenario.scenario_path("batch-delay").read_text())
    document["workers"][0]["max_batch_size"] = 8
    document["traffic"][0]["arrivals"]["rate"] = 10
    table, rows = truth_of_features(Example("batch-delay", "batch-fills", document, 1, 240.0))
    assert {f"{r.state}/{r.cause}" for r in rows if r is not None} == {"balanced/none"}
    assert min(causes.batch_idle_share(table)) >= causes.BATCH_IDLE_SHARE
    assert max(table.column("utilization_ratio")) < causes.BATCH_WAIT_BUSY
    assert min(table.column("rho_fitted_ratio")) >= causes.BATCH_WAIT_RHO
    named = causes.named(table)
    assert set(named.starved) == {"batch_delay"}  # the cause, should the state be starved
    assert not named.waiting.any()


def test_a_gpu_whose_feeder_is_pinned_and_whose_work_is_light_is_starved_by_its_host() -> None:
    # the shipped host-bound server: GPU 2's feeder runs at its one core and the GPU, with
    # nothing queued, has work for under 30 % of the window at full batches; starved by its
    # host by its truth. Half the probability on balanced, half on starved/host_bound (what
    # the shipped model gave it, under the verdict's 0.6) all goes to starved/host_bound
    document = yaml.safe_load(scenario.scenario_path("host-bound").read_text())
    table, rows = truth_of_features(Example("host-bound", "host-bound", document, 1, 300.0))
    named = causes.named(table)
    gpu2 = [i for i, f in enumerate(table.frames) if f.gpu == 2 and rows[i] is not None]
    late = [i for i in gpu2 if f"{rows[i].state}/{rows[i].cause}" == "starved/host_bound"]
    assert len(late) >= 5 and all(named.held_back[i] for i in late)
    classes = np.array(["balanced/none", "starved/host_bound", "starved/low_demand"])
    even = np.tile([0.5, 0.4, 0.1], (len(table.frames), 1))
    moved = causes.apply(even, classes, table)
    assert moved[late].tolist() == [[0.0, 1.0, 0.0]] * len(late)
    # a balanced server's feeders are not pinned: nothing named
    balanced = yaml.safe_load(scenario.scenario_path("balanced-4x4090").read_text())
    table, _ = truth_of_features(Example("balanced", "balanced", balanced, 1, 240.0))
    assert not causes.named(table).held_back.any()


def test_the_model_names_batch_delay_on_a_server_it_was_not_trained_on() -> None:
    # one generated batch-wait server teaches batch_delay; the shipped batch-delay run (other
    # cards, model and rates) is starved/batch_delay in every window by its truth
    examples = [
        Example(n, n, yaml.safe_load(scenario.scenario_path(n).read_text()), 1, 240.0)
        for n in ("balanced-4x4090", "overprovisioned-fleet", "io-bound")
    ]
    variant = generate.variants("batch-wait", 1, 1)[0]
    examples.append(Example(variant.family, variant.name, variant.document, 1, 240.0))
    training = build_dataset(examples, workers=1)
    document = yaml.safe_load(scenario.scenario_path("batch-delay").read_text())
    judged = build_dataset([Example("batch-delay", "batch-delay", document, 1, 240.0)], workers=1)
    assert set(judged.labels) == {"starved/batch_delay"}
    fitted = GpuStateClassifier(max_iter=5).fit(training.table, training.labels)
    assert set(fitted.predict(judged.table)) == {"starved/batch_delay"}


def test_allocation_failures_name_memory_pressure_without_a_deep_queue_or_kv_figure() -> None:
    # fragmented-memory: 13B INT8 with mixed RAG prompts, oom outcomes from a short queue;
    # a generated slow card far behind its queue fails allocations too, overloaded/slow_card
    fragmented = yaml.safe_load(scenario.scenario_path("fragmented-memory").read_text())
    slow = generate.variants("slow-card", 2, 1)[1]
    data = build_dataset(
        [
            Example("fragmented-memory", "fragmented-memory", fragmented, 1, 240.0),
            Example(slow.family, slow.name, slow.document, int(slow.document["seed"])),
        ],
        workers=1,
    )
    # as a server that reports no KV cache (TGI, Triton) has them
    values = data.table.values.copy()
    values[:, COLUMNS.index("kv_cache_usage_ratio")] = np.nan
    blank = FeatureTable(data.table.frames, values)
    failing = data.table.column("allocation_failures_per_completion") > causes.ALLOCATION_FAILURES
    named = causes.named(blank).overloaded
    labels = np.asarray(data.labels)
    runs = np.asarray(data.runs)
    memory = failing & (runs == "fragmented-memory") & (labels == "overloaded/memory_pressure")
    behind = failing & (runs == slow.name)
    assert memory.any() and behind.any()
    assert set(named[memory]) == {"memory_pressure"}
    assert "overloaded/memory_pressure" not in set(labels[behind])
    assert "memory_pressure" not in set(named[behind])
    # where the server reports its KV cache, what a full batch would need of it decides,
    # whatever allocations failed
    reported = causes.named(data.table)
    full = reported.kv_full_batch >= causes.KV_FULL_BATCH
    assert not np.isnan(reported.kv_full_batch[memory]).any()
    assert ((reported.overloaded == "memory_pressure") == full).all()


def test_a_kv_cache_nearly_empty_or_a_full_batch_would_not_fill_is_no_memory_pressure(
    tmp_path: Path,
) -> None:
    # the default demo under least connections: GPU 0 takes most of the work at a deep queue
    # and full batches (a memory-limited server's look) with its KV cache about 1 % full and
    # no allocation failing
    document = yaml.safe_load(scenario.scenario_path("skewed-heterogeneous").read_text())
    document["router"]["policy"] = "least_connections"
    path = tmp_path / "skewed-leastconn.yaml"
    path.write_text(yaml.safe_dump(document))
    table = _table(str(path), 120, tmp_path / "run")
    hot = [i for i, f in enumerate(table.frames) if f.gpu == 0]
    table = FeatureTable(tuple(table.frames[i] for i in hot), table.values[hot].copy())
    assert max(table.column("kv_cache_usage_ratio")) < causes.KV_IDLE
    assert max(table.column("allocation_failures_per_completion")) == 0
    classes = np.asarray(
        [
            "balanced/none",
            "overloaded/memory_pressure",
            "overloaded/routing_skew",
            "overloaded/slow_card",
        ]
    )
    learned = np.tile([0.2, 0.6, 0.15, 0.05], (len(hot), 1))
    # the memory share goes to the other overloaded causes as they stood, 3 to 1
    moved = np.tile([0.2, 0.0, 0.6, 0.2], (len(hot), 1))
    assert np.allclose(causes.apply(learned, classes, table), moved)
    # no KV figure (its batches short of their limit), with or without an allocation failing:
    # the learned answer stands; with the KV figure, a failing allocation changes nothing
    kv = COLUMNS.index("kv_cache_usage_ratio")
    failures = COLUMNS.index("allocation_failures_per_completion")
    for failed, blank_kv, expected in (
        (0.001, False, moved),
        (0.001, True, learned),
        (0, True, learned),
    ):
        values = table.values.copy()
        values[:, failures] = failed
        if blank_kv:
            values[:, kv] = np.nan
        changed = FeatureTable(table.frames, values)
        assert np.allclose(causes.apply(learned, classes, changed), expected), (failed, blank_kv)
    # a KV cache in use: what a full batch would need of it decides. Half the region: no
    # memory pressure, as nearly empty; 0.8 or more, on the hot GPU's work (enough to fill
    # its batches): the whole probability is memory pressure's, the state's as well
    assert min(table.column("rho_fitted_ratio")) >= causes.MEMORY_BUSY_RHO
    per_request = np.array([f.running_mean / f.max_batch_size for f in table.frames])
    memory = np.tile([0.0, 1.0, 0.0, 0.0], (len(hot), 1))
    for full_batch, expected in ((0.5, moved), (0.8, memory)):
        values = table.values.copy()
        values[:, kv] = full_batch * per_request
        changed = FeatureTable(table.frames, values)
        assert np.allclose(causes.kv_full_batch_ratio(changed), full_batch)
        assert np.allclose(causes.apply(learned, classes, changed), expected), full_batch


class _Answers:
    """A model that answers the same for every row, the named causes applied as the model
    applies them."""

    def __init__(self, classes: np.ndarray, learned: np.ndarray) -> None:
        self.classes_, self.learned = classes, learned

    def predict_proba(self, table: FeatureTable) -> np.ndarray:
        return causes.apply(self.learned, self.classes_, table)


def test_a_full_batch_that_would_fill_the_kv_region_and_the_work_to_fill_it_name_the_state(
    tmp_path: Path,
) -> None:
    classes = np.asarray(
        [
            "balanced/none",
            "overloaded/capacity_shortage",
            "overloaded/memory_pressure",
            "starved/low_demand",
        ]
    )
    memory = _table("fragmented-memory", 120, tmp_path / "memory")
    shortage = _table("capacity-shortage", 120, tmp_path / "shortage")
    for table, named in ((memory, True), (shortage, False)):
        learned = np.tile([0.5, 0.2, 0.1, 0.2], (len(table.frames), 1))
        fires = causes.named(table).short_of_memory
        # the memory scenario's GPUs in most windows, the capacity shortage's in none
        assert fires.mean() >= 0.75 if named else not fires.any()
        out = causes.apply(learned, classes, table)
        assert np.allclose(out[fires], [0.0, 0.0, 1.0, 0.0])
        assert np.allclose(out[~fires, 0], 0.5) and np.allclose(out[~fires, 3], 0.2)
    # the verdict says what named it, first
    hits = causes.named(memory).short_of_memory
    fired = {(f.gpu, f.t_start) for f, hit in zip(memory.frames, hits, strict=True) if hit}
    learned = np.tile([0.5, 0.2, 0.1, 0.2], (len(memory.frames), 1))
    verdicts = Verdicts(_Answers(classes, learned)).diagnose(memory).verdicts
    named = [v for v in verdicts if (v.gpu, v.t_start) in fired]
    assert len(named) == len(fired)
    for verdict in named:
        assert (verdict.state, verdict.cause) == ("overloaded", "memory_pressure")
        assert re.match(
            r"a full batch of \d+ would need \d+ % of the KV cache", verdict.evidence[0]
        )
    # less work than would fill its batches: the state is the model's, the overloaded
    # probability memory pressure's
    values = memory.values.copy()
    values[:, COLUMNS.index("rho_fitted_ratio")] = causes.MEMORY_BUSY_RHO - 0.05
    light = FeatureTable(memory.frames, values)
    assert not causes.named(light).short_of_memory.any()
    assert np.allclose(causes.apply(learned, classes, light)[hits], [0.5, 0.0, 0.3, 0.2])


def test_batches_at_their_limit_with_no_allocation_failing_are_no_memory_pressure(
    tmp_path: Path,
) -> None:
    # the default demo: GPU 0, the weighted round robin's default target, runs full batches at
    # a deep queue, no allocation failing; its server reports no KV figure (TGI, Triton)
    table = _table("skewed-heterogeneous", 120, tmp_path / "run")
    hot = [i for i, f in enumerate(table.frames) if f.gpu == 0]
    blank = table.values[hot].copy()
    blank[:, COLUMNS.index("kv_cache_usage_ratio")] = np.nan
    frames = tuple(table.frames[i] for i in hot)
    assert max(blank[:, COLUMNS.index("allocation_failures_per_completion")]) == 0
    assert all(
        f.max_batch_size == 8
        and f.batch_size_mean is not None
        and f.batch_size_mean >= causes.FULL_BATCH_RATIO * 8
        for f in frames
    )
    classes = np.asarray(["overloaded/memory_pressure", "overloaded/routing_skew"])
    learned = np.tile([0.7, 0.3], (len(hot), 1))
    # the batches the exporter was told it may run all ran: memory held them
    moved = causes.apply(learned, classes, FeatureTable(frames, blank))
    assert np.allclose(moved, np.tile([0.0, 1.0], (len(hot), 1)))
    # no limit told, or a limit its batches fall short of: the learned answer stands
    for limit in (None, 16):
        told = tuple(dataclasses.replace(f, max_batch_size=limit) for f in frames)
        changed = FeatureTable(told, blank)
        assert np.allclose(causes.apply(learned, classes, changed), learned), limit


@pytest.mark.parametrize(
    ("name", "cause", "routed"),
    [
        # weighted round robin sends GPU 0 most of the work: the others starve by their routing
        ("skewed-heterogeneous", "starved/routing_skew", True),
        ("sticky-sessions-skew", "starved/routing_skew", True),
        # eight GPUs for the work of two: every one starves by low demand
        ("overprovisioned-fleet", "starved/low_demand", False),
    ],
)
def test_a_busy_peer_and_enough_work_for_a_split_by_capacity_name_routing_skew(
    name: str, cause: str, routed: bool
) -> None:
    document = yaml.safe_load(scenario.scenario_path(name).read_text())
    data = build_dataset([Example(name, name, document, 1, 240.0)], workers=1)
    rows = np.flatnonzero(np.asarray(data.labels) == cause)
    assert len(rows) >= 10
    table = data.table.take(rows)
    names = causes.named(table)
    assert names.routed.all() == routed and names.unrouted.all() != routed
    # decisive between the two, and only between them
    classes = np.asarray(["balanced/none", "starved/low_demand", "starved/routing_skew"])
    learned = np.tile([0.3, 0.5, 0.2] if routed else [0.3, 0.2, 0.5], (len(rows), 1))
    expected = np.tile([0.3, 0.0, 0.7] if routed else [0.3, 0.7, 0.0], (len(rows), 1))
    assert np.allclose(causes.apply(learned, classes, table), expected)
    # the pool's work not known: the learned split stands where a busy peer says routing,
    # and a peer under 0.6 still rules routing out
    values = table.values.copy()
    values[:, COLUMNS.index("pool_fair_rho_fitted_ratio")] = np.nan
    unknown = causes.apply(learned, classes, FeatureTable(table.frames, values))
    assert np.allclose(unknown, learned if routed else expected)
