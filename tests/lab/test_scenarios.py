"""The shipped lab scenarios: they load, they show the verdict they were written for, they are
deterministic, bad scenarios fail early with file, line and key, and the README is enough to
write a scenario and to predict its ground truth."""

from __future__ import annotations

import csv
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from gpubalance.cli import main
from gpubalance.config import ConfigError
from gpubalance.lab import run as lab_run
from gpubalance.lab import scenario
from gpubalance.lab.catalogue import CARDS
from gpubalance.lab.model.service import ServiceModel
from gpubalance.lab.truth import CAUSES

README_SCENARIO = Path(__file__).resolve().parents[1] / "data" / "scenario-from-readme.yaml"
SHIPPED = sorted(path.stem for path in scenario.SCENARIOS.glob("*.yaml"))
OUTPUTS = ("frames.csv", "truth.csv", "truth_evidence.csv", "requests.csv")


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@dataclass(frozen=True)
class Expect:
    """What a scenario is for: (state, cause) pairs that must each appear for a GPU."""

    duration: float = 300.0
    shows: dict[int, set[tuple[str, str]]] = field(default_factory=dict)
    mostly_balanced: float | None = None  # least share of balanced rows, over all GPUs


OVERLOADED_SKEW = ("overloaded", "routing_skew")
STARVED_SKEW = ("starved", "routing_skew")
BALANCED = ("balanced", "none")

EXPECTED: dict[str, Expect] = {
    "balanced-4x4090": Expect(mostly_balanced=0.9),
    "balanced-heterogeneous": Expect(mostly_balanced=0.9),
    "steady-4gpu-40rps": Expect(mostly_balanced=1.0),
    "separate-pools": Expect(mostly_balanced=0.7),
    "skewed-heterogeneous": Expect(
        shows={0: {OVERLOADED_SKEW}, 1: {STARVED_SKEW}, 2: {STARVED_SKEW}, 3: {STARVED_SKEW}}
    ),
    "default-target": Expect(shows={0: {OVERLOADED_SKEW, BALANCED}, 1: {STARVED_SKEW, BALANCED}}),
    "slow-card-round-robin": Expect(shows={3: {("overloaded", "slow_card")}, 0: {BALANCED}}),
    "batch-delay": Expect(shows={0: {("starved", "batch_delay")}, 1: {("starved", "batch_delay")}}),
    "fragmented-memory": Expect(
        shows={0: {("overloaded", "memory_pressure")}, 1: {("overloaded", "memory_pressure")}}
    ),
    "host-bound": Expect(shows={2: {BALANCED, ("starved", "host_bound")}, 0: {BALANCED}}),
    "io-bound": Expect(shows={g: {BALANCED, ("starved", "io_bound")} for g in range(4)}),
    "thermal-throttle": Expect(shows={1: {BALANCED, ("overloaded", "throttling")}, 0: {BALANCED}}),
    "sticky-sessions-skew": Expect(shows={2: {OVERLOADED_SKEW}, 1: {STARVED_SKEW}}),
    "multi-tenant-fairness": Expect(
        duration=720.0,  # the whole compressed day: the big tenant peaks mid-run
        shows={0: {BALANCED, OVERLOADED_SKEW}, 3: {("starved", "low_demand")}},
    ),
    "mixed-interactive-batch": Expect(
        shows={g: {("overloaded", "class_interference")} for g in range(4)}
    ),
    "capacity-shortage": Expect(
        shows={g: {BALANCED, ("overloaded", "capacity_shortage")} for g in range(4)}
    ),
    "overprovisioned-fleet": Expect(
        duration=600.0, shows={g: {("starved", "low_demand")} for g in range(8)}
    ),
    "worker-crash": Expect(shows={1: {BALANCED, ("starved", "worker_crash")}, 0: {BALANCED}}),
    "gpu-lost": Expect(shows={0: {BALANCED, ("overloaded", "capacity_shortage")}, 2: {BALANCED}}),
    "pool-demand-shift": Expect(
        duration=600.0,  # the whole compressed day: each pool peaks once
        shows={
            g: {BALANCED, ("overloaded", "capacity_shortage"), ("starved", "low_demand")}
            for g in range(4)
        },
    ),
    "pool-demand-peaks": Expect(
        duration=1800.0,  # the whole day: each pool peaks once
        shows={
            g: {BALANCED, ("overloaded", "capacity_shortage"), ("starved", "low_demand")}
            for g in range(4)
        },
    ),
}


class Runs:
    """Each scenario run once at the fast speed, shared by the tests that look at it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, Path] = {}

    def __call__(self, name: str) -> Path:
        if name not in self.done:
            plan = scenario.load(name)
            out = self.root / name
            lab_run.run(plan, "fast", EXPECTED[name].duration, plan.scenario.seed, out)
            self.done[name] = out
        return self.done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("scenarios"))


# -- the shipped set -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_scenario_loads_and_is_named_after_its_file(name: str) -> None:
    plan = scenario.load(name)
    assert plan.scenario.name == name
    assert plan.scenario.description.strip() and "\n" not in plan.scenario.description


def test_lab_list_shows_every_shipped_scenario() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gpubalance", "lab", "list"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.strip()]
    assert listed == SHIPPED
    assert len(listed) >= 12


def test_every_shipped_scenario_has_an_expectation_and_together_they_cover_every_cause() -> None:
    assert set(EXPECTED) == set(SHIPPED)
    shown = {cause for e in EXPECTED.values() for pairs in e.shows.values() for _, cause in pairs}
    shown |= {"none"} if any(e.mostly_balanced for e in EXPECTED.values()) else set()
    assert shown == set(CAUSES)


def test_every_router_policy_and_event_kind_is_used_by_some_scenario() -> None:
    plans = [scenario.load(name).scenario for name in SHIPPED]
    assert {p.router.policy for p in plans} == {
        "round_robin",
        "weighted_round_robin",
        "least_connections",
        "random_of_2",
        "sticky",
        "pooled",
    }
    assert {e.action for p in plans for e in p.events} == set(scenario.ACTIONS)


# -- each scenario shows what it was written for --------------------------------------------------


@pytest.mark.parametrize("name", SHIPPED)
def test_scenario_shows_its_intended_truth(name: str, runs: Runs) -> None:
    rows = read_csv(runs(name) / "truth.csv")
    assert rows, "no truth rows"
    expect = EXPECTED[name]
    for gpu, wanted in expect.shows.items():
        seen = {(r["state"], r["cause"]) for r in rows if int(r["gpu"]) == gpu}
        missing = wanted - seen
        assert not missing, f"GPU {gpu}: {sorted(missing)} never shown; saw {sorted(seen)}"
    if expect.mostly_balanced is not None:
        verdicts = Counter((r["state"], r["cause"]) for r in rows)
        share = verdicts[BALANCED] / len(rows)
        assert share >= expect.mostly_balanced, f"balanced in {share:.0%} of rows: {verdicts}"


def test_fragmented_memory_fails_requests_with_oom(runs: Runs) -> None:
    outcomes = Counter(r["outcome"] for r in read_csv(runs("fragmented-memory") / "requests.csv"))
    assert outcomes["oom"] > 0
    assert outcomes["ok"] > 10 * outcomes["oom"]  # most requests still fit


def test_lost_gpu_has_no_truth_after_it_is_lost(runs: Runs) -> None:
    rows = read_csv(runs("gpu-lost") / "truth.csv")
    gpu2 = [float(r["t_end"]) for r in rows if r["gpu"] == "2"]
    assert gpu2 and max(gpu2) <= 150
    assert any(float(r["t_start"]) >= 150 for r in rows if r["gpu"] == "0")
    frames = read_csv(runs("gpu-lost") / "frames.csv")
    assert {f["lost"] for f in frames if f["gpu"] == "2" and float(f["t"]) > 150} == {"1"}


def test_busy_is_not_full_nvml_utilisation_saturates_while_truth_is_balanced(runs: Runs) -> None:
    out = runs("steady-4gpu-40rps")
    utilisation = [float(f["utilization"]) for f in read_csv(out / "frames.csv")]
    assert np.mean(utilisation) >= 0.9
    rho = [float(r["rho"]) for r in read_csv(out / "truth_evidence.csv")]
    assert max(rho) < 0.6


def test_overprovisioned_fleet_idles_like_public_fleet_data(runs: Runs) -> None:
    # AcmeTrace/Philly/PAI: 26-41 % of GPU samples <= 1 %; GenTD26: 72 % of samples < 5 %
    utilisation = np.array(
        [float(f["utilization"]) for f in read_csv(runs("overprovisioned-fleet") / "frames.csv")]
    )
    assert 0.3 <= np.mean(utilisation <= 0.01) <= 0.85
    assert np.mean(utilisation >= 0.9) >= 0.05  # bimodal: the bursts read busy


def test_separate_pools_spare_interactive_requests_the_batch_queue(runs: Runs) -> None:
    def p99_interactive(name: str) -> float:
        rows = read_csv(runs(name) / "requests.csv")
        latency = [
            float(r["end"]) - float(r["arrival"])
            for r in rows
            if r["class"] == "interactive" and r["outcome"] == "ok"
        ]
        return float(np.percentile(latency, 99))

    assert p99_interactive("separate-pools") < 0.5 * p99_interactive("mixed-interactive-batch")


# -- determinism -----------------------------------------------------------------------------------


def test_same_seed_gives_identical_files_and_another_seed_other_requests(tmp_path: Path) -> None:
    plan = scenario.load("skewed-heterogeneous")
    for out, seed in (("a", 1), ("b", 1), ("c", 2)):
        lab_run.run(plan, "fast", 120.0, seed, tmp_path / out)
    for name in OUTPUTS:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / "requests.csv").read_bytes() != (
        tmp_path / "c" / "requests.csv"
    ).read_bytes()


# -- bad scenarios fail before running, with file, line and key ------------------------------------

GOOD = """\
name: bad
description: "a scenario with one mistake"
hardware:
  gpus:
    - card: RTX 4090
models:
  small:
    params_billions: 3.21
workers:
  - gpu: 0
    model: small
router:
  policy: round_robin
traffic:
  - name: chat
    class: interactive
    arrivals: {kind: poisson, rate: 1}
    prompt_tokens: {kind: fixed, value: 100}
    output_tokens: {kind: fixed, value: 10}
"""

BAD = {
    "unknown key": (
        ("    model: small\n", "    model: small\n    max_batch: 8\n"),
        12,
        "workers.0.max_batch: unknown key",
    ),
    "wrong type": (
        ("    model: small\n", "    model: small\n    max_batch_size: eight\n"),
        12,
        "workers.0.max_batch_size: expected an integer, got 'eight'",
    ),
    "model larger than its card": (
        ("    params_billions: 3.21\n", "    params_billions: 13.0\n"),
        11,
        "workers.0.model: impossible placement: 1 worker(s) need 25.2 GiB for weights on GPU 0 "
        "(NVIDIA GeForce RTX 4090, 24.0 GiB)",
    ),
    "unknown worker in an event": (
        (
            "    output_tokens: {kind: fixed, value: 10}\n",
            "    output_tokens: {kind: fixed, value: 10}\n"
            "events:\n  - at: 10\n    worker_crash:\n      worker: w9\n",
        ),
        23,
        "events.0.worker_crash.worker: no worker named 'w9'",
    ),
    "worker name taken twice": (
        (
            "  - gpu: 0\n    model: small\n",
            "  - gpu: 0\n    name: a\n    model: small\n"
            "  - gpu: 0\n    name: a\n    model: small\n",
        ),
        14,
        "workers.1.name: worker name 'a' is already taken by workers entry 0",
    ),
    "event at the end": (
        (
            "    output_tokens: {kind: fixed, value: 10}\n",
            "    output_tokens: {kind: fixed, value: 10}\n"
            "events:\n  - at: 600\n    disk: {disk_mb_per_second: 100}\n",
        ),
        21,
        "events.0.at: at 600 s must be earlier than the end (600 s, duration_seconds)",
    ),
    "negative seed": (
        (
            'description: "a scenario with one mistake"\n',
            'description: "a scenario with one mistake"\nseed: -1\n',
        ),
        3,
        "seed: Input should be greater than or equal to 0 (got -1)",
    ),
    "pool without workers": (
        ("  policy: round_robin\n", "  policy: round_robin\n  pools:\n    batch: jobs\n"),
        15,
        "router.pools.batch: no worker in pool 'jobs'; pools: default",
    ),
}


def write_bad(tmp_path: Path, case: str) -> tuple[Path, str]:
    (old, new), line, message = BAD[case]
    assert GOOD.count(old) == 1
    path = tmp_path / "bad.yaml"
    path.write_text(GOOD.replace(old, new))
    return path, f"{path}:{line}: {message}"


def test_the_base_of_the_bad_scenarios_is_good(tmp_path: Path) -> None:
    path = tmp_path / "good.yaml"
    path.write_text(GOOD)
    scenario.load(str(path))


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_scenario_fails_with_file_line_and_key(tmp_path: Path, case: str) -> None:
    path, expected = write_bad(tmp_path, case)
    with pytest.raises(ConfigError) as caught:
        scenario.load(str(path))
    assert str(caught.value) == expected


@pytest.mark.parametrize("case", sorted(BAD))
def test_cli_rejects_bad_scenario_with_exit_2_and_one_line(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path, expected = write_bad(tmp_path, case)
    code = main(["lab", "run", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [f"gpubalance lab: {expected}"]
    assert not (tmp_path / "out").exists()  # nothing ran


# -- valid scenarios that will go wrong: warnings ----------------------------------------------


def warnings_of(
    tmp_path: Path, old: str, new: str, duration: float | None = None
) -> tuple[Path, list[str], int]:
    """The warnings of GOOD with one change, and the line the change starts on."""
    assert GOOD.count(old) == 1
    text = GOOD.replace(old, new)
    path = tmp_path / "warns.yaml"
    path.write_text(text)
    line = text[: text.index(new) + len(old)].count("\n") + 1
    return path, scenario.load(str(path)).warnings(duration), line


def test_a_good_scenario_has_no_warnings(tmp_path: Path) -> None:
    path = tmp_path / "good.yaml"
    path.write_text(GOOD)
    assert scenario.load(str(path)).warnings() == []


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_scenarios_have_no_warnings(name: str) -> None:
    assert scenario.load(name).warnings() == []


def test_a_kv_region_smaller_than_one_mean_request_warns_and_fails_requests_with_oom(
    tmp_path: Path,
) -> None:
    # 110 tokens x 128 KiB of KV per request: 14 MiB, against a region of 10 MiB
    path, warnings, line = warnings_of(
        tmp_path, "    model: small\n", "    model: small\n    kv_cache_gib: 0.01\n"
    )
    assert warnings == [
        f"{path}:{line}: workers.0.kv_cache_gib: worker w0's KV region (10 MiB) is smaller than "
        "the mean request of pool 'default' (14 MiB of KV cache): most of its requests will "
        "fail with oom"
    ]
    # what the warning is about
    plan = scenario.load(str(path))
    lab_run.run(plan, "fast", 60.0, 1, tmp_path / "out")
    outcomes = Counter(r["outcome"] for r in read_csv(tmp_path / "out" / "requests.csv"))
    assert outcomes["oom"] >= 0.99 * sum(outcomes.values())


def test_events_at_or_after_a_shorter_run_end_warn(tmp_path: Path) -> None:
    old = "    output_tokens: {kind: fixed, value: 10}\n"
    events = "events:\n  - at: 100\n    disk: {disk_mb_per_second: 100}\n"
    path, warnings, line = warnings_of(tmp_path, old, old + events, duration=100.0)
    assert warnings == [
        f"{path}:{line + 1}: events.0.at: at 100 s, not earlier than the run's end (100 s): the "
        "disk event falls after the run's arrivals, frames and truth"
    ]
    assert scenario.load(str(path)).warnings(100.5) == []
    assert scenario.load(str(path)).warnings() == []  # the scenario's own 600 s


def test_a_pool_offered_over_three_times_what_it_serves_warns(tmp_path: Path) -> None:
    a, d = ServiceModel(CARDS["RTX 4090"], 3.21).request_cost_seconds(
        8, np.array([100]), np.array([10])
    )
    capacity = 1 / float(a[0] + d[0])
    for ratio, warns in ((3.2, True), (2.8, False)):
        rate = f"rate: {ratio * capacity:.3f}}}"
        path, warnings, _ = warnings_of(tmp_path, "rate: 1}", rate)
        if not warns:
            assert warnings == []
            continue
        (warning,) = warnings
        assert warning.startswith(f"{path}:14: traffic: pool 'default' is offered ")
        assert f", {ratio:.1f}x the {capacity:.1f} its workers serve at full batches" in warning
        assert warning.endswith("its queues will grow all run long")


# -- the README is enough ----------------------------------------------------------------------


def test_scenario_written_from_the_readme_matches_the_readme_rules(tmp_path: Path) -> None:
    plan = scenario.load(str(README_SCENARIO))
    out = tmp_path / "readme"
    lab_run.run(plan, "fast", plan.scenario.duration_seconds, plan.scenario.seed, out)
    requests = read_csv(out / "requests.csv")
    evidence = {(r["t_start"], int(r["gpu"])): r for r in read_csv(out / "truth_evidence.csv")}
    truth = {
        (r["t_start"], int(r["gpu"])): (r["state"], r["cause"]) for r in read_csv(out / "truth.csv")
    }
    width = plan.scenario.truth_window_seconds

    # README, "Work per request": (a, d) per request in a full batch of B; fixed tokens, so the
    # static-batching inflation is 1.
    chat_a, chat_d = ServiceModel(CARDS["RTX 4090"], 8.03).request_cost_seconds(
        8, np.array([256]), np.array([32])
    )
    report_a, report_d = ServiceModel(CARDS["RTX 4070 Ti"], 3.21).request_cost_seconds(
        4, np.array([1024]), np.array([64])
    )
    checked = 0
    for k in range(int(plan.scenario.duration_seconds // width)):
        start, end = k * width, (k + 1) * width
        arrived = [r for r in requests if start <= float(r["arrival"]) < end]
        chat = sum(r["class"] == "interactive" for r in arrived)
        reports = sum(r["class"] == "reports" for r in arrived)
        # round robin over the two chat workers, each up all the time: share 1/2
        rho_chat = chat / 2 * float(chat_a[0] + chat_d[0]) / width
        rho_reports = reports * float(report_a[0] + report_d[0]) / width
        key = f"{start:g}"
        for gpu in (0, 1):
            assert float(evidence[key, gpu]["rho"]) == pytest.approx(rho_chat, rel=0.05)
        assert float(evidence[key, 2]["rho"]) == pytest.approx(rho_reports, rel=0.05)
        # README, "Decision": the chat GPUs need more than the window. GPU 2 idles, but it
        # serves another model, so the GPUs that could take chat work are the two chat GPUs,
        # both overloaded: fair rho >= 0.85, capacity_shortage. GPU 2 is alone in its pool (no
        # busy peer), has no crash, no CPU or IO limit and no queue delay: low_demand.
        if rho_chat >= 0.85 and rho_reports < 0.3:
            for gpu in (0, 1):
                assert float(evidence[key, gpu]["fair_rho"]) == pytest.approx(rho_chat, rel=0.05)
                assert truth[key, gpu] == ("overloaded", "capacity_shortage")
            assert truth[key, 2] == ("starved", "low_demand")
            checked += 1
    assert checked >= 2
