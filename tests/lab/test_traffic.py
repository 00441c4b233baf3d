"""The lab's request stream: determinism, the statistics of each arrival kind, tokens, schema."""

from __future__ import annotations

import csv
import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from gpubalance.lab.traffic import (
    DATA_DIR,
    TrafficSource,
    generate,
    interarrival_cv,
    trace_statistics,
)
from gpubalance.lab.workload import Request

FIXED = {"kind": "fixed", "value": 1}


def source(
    name: str = "chat", arrivals: dict[str, Any] | None = None, **fields: Any
) -> TrafficSource:
    """A valid source from YAML-like dicts; keyword fields override the defaults."""
    spec: dict[str, Any] = {
        "name": name,
        "class": "interactive",
        "arrivals": arrivals or {"kind": "poisson", "rate": 20.0},
        "prompt_tokens": FIXED,
        "output_tokens": FIXED,
    }
    spec.update(fields)
    return TrafficSource.model_validate(spec)


def arrivals_of(requests: list[Request]) -> np.ndarray:
    return np.array([r.arrival_seconds for r in requests])


def replay(**arrivals: Any) -> TrafficSource:
    return source(
        "code",
        {"kind": "trace", "trace": "azure_code", **arrivals},
        prompt_tokens={"kind": "trace"},
        output_tokens={"kind": "trace"},
    )


def read_bundled_azure_code() -> list[dict[str, str]]:
    with open(DATA_DIR / "AzureLLMInferenceTrace_code.csv", newline="") as f:
        return list(csv.DictReader(f))


# -- determinism and ordering ------------------------------------------------------------------


def mixed_sources() -> list[TrafficSource]:
    return [
        source("chat", {"kind": "poisson", "rate": 5.0}, sessions={"count": 50, "skew": 1.0}),
        source(
            "bursts",
            {"kind": "onoff", "rate": 30.0, "on_seconds": 5.0, "off_seconds": 10.0},
            prompt_tokens={"kind": "lognormal", "median": 500.0, "p90": 1500.0, "max": 4096},
        ),
        replay(time_scale=2.0),
    ]


def test_same_seed_gives_the_same_list_and_another_seed_another() -> None:
    first = generate(mixed_sources(), 600.0, seed=7)
    assert first == generate(mixed_sources(), 600.0, seed=7)
    assert repr(first) == repr(generate(mixed_sources(), 600.0, seed=7))  # as written out
    assert first != generate(mixed_sources(), 600.0, seed=8)


def test_sorted_by_arrival_with_ids_in_order_and_inside_the_run() -> None:
    requests = generate(mixed_sources(), 600.0, seed=1)
    assert [r.id for r in requests] == list(range(len(requests)))
    times = arrivals_of(requests)
    assert np.all(np.diff(times) >= 0)
    assert times[0] >= 0 and times[-1] < 600.0
    assert {r.source for r in requests} == {"chat", "bursts", "code"}


def test_ties_follow_source_order() -> None:
    # the same trace replayed twice gives identical timestamps: the first source goes first
    requests = generate([replay(), source("copy", replay().arrivals.model_dump())], 60.0, 1)
    assert [r.source for r in requests[:4]] == ["code", "copy", "code", "copy"]


def test_adding_a_source_leaves_the_others_unchanged() -> None:
    def by_source(requests: list[Request], name: str) -> list[tuple[Any, ...]]:
        return [
            (r.arrival_seconds, r.prompt_tokens, r.output_tokens, r.session)
            for r in requests
            if r.source == name
        ]

    before = generate(mixed_sources(), 600.0, seed=3)
    extra = source("new", {"kind": "poisson", "rate": 50.0})
    after = generate([extra, *mixed_sources()], 600.0, seed=3)
    for name in ("chat", "bursts", "code"):
        assert by_source(after, name) == by_source(before, name)


def test_changing_tokens_leaves_arrivals_unchanged() -> None:
    lognormal = {"kind": "lognormal", "median": 100.0, "p90": 300.0, "max": 1000}
    fixed = generate([source()], 300.0, seed=2)
    drawn = generate([source(prompt_tokens=lognormal)], 300.0, seed=2)
    assert np.array_equal(arrivals_of(fixed), arrivals_of(drawn))


def test_one_hour_at_40_per_second_has_every_request() -> None:
    # how fast it is, bench/lab.py measures: a test asserts no wall time
    chat = source(
        arrivals={"kind": "poisson", "rate": 40.0},
        prompt_tokens={"kind": "lognormal", "median": 1000.0, "p90": 2700.0, "max": 8192},
        sessions={"count": 200, "skew": 1.1},
    )
    requests = generate([chat], 3600.0, seed=1)
    assert len(requests) == pytest.approx(144_000, rel=0.02)


# -- arrival kinds -----------------------------------------------------------------------------


def test_poisson_rate_and_cv() -> None:
    times = arrivals_of(generate([source(arrivals={"kind": "poisson", "rate": 50.0})], 2000.0, 1))
    assert len(times) / 2000.0 == pytest.approx(50.0, rel=0.02)
    assert interarrival_cv(times) == pytest.approx(1.0, abs=0.03)


def test_onoff_mean_rate_and_burstiness() -> None:
    onoff = {"kind": "onoff", "rate": 6.0, "on_seconds": 2.0, "off_seconds": 4.0}
    times = arrivals_of(generate([source(arrivals=onoff)], 20_000.0, 1))
    assert len(times) / 20_000.0 == pytest.approx(6.0 * 2.0 / 6.0, rel=0.08)
    assert interarrival_cv(times) > 2.0


def test_diurnal_follows_its_rate_curve() -> None:
    mean, amplitude, period, phase = 20.0, 0.6, 600.0, 150.0
    diurnal = {
        "kind": "diurnal",
        "mean_rate": mean,
        "amplitude": amplitude,
        "period_seconds": period,
        "phase_seconds": phase,
    }
    duration = 10 * period
    times = arrivals_of(generate([source(arrivals=diurnal)], duration, 1))
    assert len(times) / duration == pytest.approx(mean, rel=0.03)
    # counts per twelfth of the cycle against the integral of the rate over that twelfth
    bins = 12
    counts = np.bincount((times % period // (period / bins)).astype(int), minlength=bins)
    edges = np.linspace(0.0, period, bins + 1)
    sine = np.sin(2 * np.pi * (edges - phase) / period)
    integral = mean * (np.diff(edges) + amplitude * period / (2 * np.pi) * np.diff(sine))
    assert counts == pytest.approx(integral * duration / period, rel=0.06)
    assert np.argmax(counts) == int(phase // (period / bins))


def test_trace_replay_keeps_rows_counts_and_cv() -> None:
    rows = read_bundled_azure_code()
    stats = trace_statistics("azure_code")
    assert stats["requests"] == len(rows) == 8819
    assert stats["interarrival_cv"] == pytest.approx(13.2, rel=0.01)  # as traces.md measured
    requests = generate([replay(loop=False)], 4 * 3600.0, seed=1)
    assert len(requests) == len(rows)
    assert [(r.prompt_tokens, r.output_tokens) for r in requests] == [
        (int(row["ContextTokens"]), int(row["GeneratedTokens"])) for row in rows
    ]
    assert requests[0].arrival_seconds == 0.0
    assert requests[-1].arrival_seconds == pytest.approx(stats["span_seconds"])
    assert interarrival_cv(arrivals_of(requests)) == pytest.approx(stats["interarrival_cv"])


@pytest.mark.parametrize("time_scale", [1.0, 4.0])
@pytest.mark.parametrize("loop", [False, True])
def test_replayed_code_trace_keeps_its_cv(time_scale: float, loop: bool) -> None:
    times = arrivals_of(generate([replay(time_scale=time_scale, loop=loop)], 7200.0, seed=1))
    assert interarrival_cv(times) == pytest.approx(13.2, rel=0.10)


def test_time_scale_multiplies_the_rate() -> None:
    stats = trace_statistics("azure_code")
    times = arrivals_of(generate([replay(time_scale=4.0)], 3 * 3600.0, seed=1))
    assert len(times) / (3 * 3600.0) == pytest.approx(4 * stats["mean_rate_rps"], rel=0.02)


def test_loop_repeats_the_trace() -> None:
    stats = trace_statistics("azure_code")
    requests = generate([replay(time_scale=2.0)], 3600.0, seed=1)
    n = stats["requests"]
    period = (stats["span_seconds"] + 1 / stats["mean_rate_rps"]) / 2.0  # one loop, scaled
    times = arrivals_of(requests)
    assert len(requests) > 2 * n
    assert times[n : 2 * n] - period == pytest.approx(times[:n], abs=1e-6)
    assert [r.prompt_tokens for r in requests[n : 2 * n]] == [r.prompt_tokens for r in requests[:n]]


def test_offset_starts_the_replay_later_in_the_trace() -> None:
    rows = read_bundled_azure_code()
    seconds = trace_statistics("azure_code")["span_seconds"]
    requests = generate([replay(offset_seconds=seconds / 2, loop=False)], 3600.0, seed=1)
    assert len(requests) < len(rows) / 2 + 1000  # only the trace's second half
    assert requests[-1].prompt_tokens == int(rows[-1]["ContextTokens"])


def test_tenants_mix_is_skewed_over_several_tenants() -> None:
    tenants = {"kind": "tenants", "trace": "servegen_language", "clients": 20, "total_rate": 40.0}
    requests = generate([source("mix", tenants, tenant="acme")], 3600.0, seed=1)
    assert len(requests) / 3600.0 == pytest.approx(40.0, rel=0.25)
    counts = Counter(r.tenant for r in requests)
    assert len(counts) >= 10
    assert all(name.startswith("acme-") and name[5:].isdigit() for name in counts)
    top5 = sum(c for _, c in counts.most_common(5)) / len(requests)
    assert top5 > 0.5  # uniform over 20 tenants would be 0.25


def test_tenants_rate_follows_total_rate() -> None:
    def rate(total_rate: float) -> float:
        tenants = {
            "kind": "tenants",
            "trace": "servegen_language",
            "clients": 30,
            "total_rate": total_rate,
            "window_seconds": 60.0,
        }
        return len(generate([source("mix", tenants)], 1440.0, seed=1)) / 1440.0

    assert rate(10.0) == pytest.approx(10.0, rel=0.25)
    assert rate(40.0) / rate(10.0) == pytest.approx(4.0, rel=0.25)


# -- tokens and sessions -----------------------------------------------------------------------


def test_lognormal_tokens_median_p90_and_max() -> None:
    lognormal = {"kind": "lognormal", "median": 1000.0, "p90": 2700.0, "max": 5000}
    requests = generate([source(prompt_tokens=lognormal)], 2500.0, seed=1)
    tokens = np.array([r.prompt_tokens for r in requests])
    assert np.median(tokens) == pytest.approx(1000.0, rel=0.03)
    assert np.percentile(tokens, 90) == pytest.approx(2700.0, rel=0.03)
    assert tokens.max() == 5000 and tokens.min() >= 1
    assert all(r.output_tokens == 1 for r in requests)


def session_share_of_top(skew: float) -> float:
    sessions = {"count": 100, "skew": skew}
    requests = generate([source(sessions=sessions)], 1000.0, seed=1)
    counts = Counter(r.session for r in requests)
    assert set(counts) <= {f"{requests[0].source}/s{k}" for k in range(100)}
    return counts.most_common(1)[0][1] / len(requests)


def test_session_skew_concentrates_requests() -> None:
    uniform, mild, strong = (session_share_of_top(s) for s in (0.0, 0.6, 1.2))
    assert uniform < 0.02  # 1 % each, plus noise
    assert uniform < mild < strong
    # P(s0) = 1 / sum_k (k+1)^-1.2 for 100 sessions
    assert strong == pytest.approx(1 / sum((k + 1) ** -1.2 for k in range(100)), rel=0.05)


def test_no_sessions_means_none() -> None:
    assert {r.session for r in generate([source()], 10.0, seed=1)} == {None}


# -- statistics helpers ------------------------------------------------------------------------


def test_interarrival_cv_of_regular_and_too_short_series() -> None:
    assert interarrival_cv([0.0, 1.0, 2.0, 3.0]) == 0.0
    assert interarrival_cv([3.0, 0.0, 1.0, 5.0]) == pytest.approx(np.std([1, 2, 2]) / (5 / 3))
    with pytest.raises(ValueError, match="two arrivals"):
        interarrival_cv([1.0])


def test_conv_trace_statistics_match_the_reference() -> None:
    stats = trace_statistics("azure_conv")
    assert stats["requests"] == 19366
    assert stats["interarrival_cv"] == pytest.approx(1.09, abs=0.01)
    assert stats["mean_rate_rps"] == pytest.approx(5.53, abs=0.01)
    with pytest.raises(ValueError, match="mooncake"):
        trace_statistics("mooncake")


# -- schema ------------------------------------------------------------------------------------

POISSON = {"kind": "poisson", "rate": 1.0}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"arrivals": {"kind": "poisson", "rate": 0}}, "rate"),
        ({"arrivals": {"kind": "poisson", "rate": "20"}}, "rate"),  # strict: no strings
        ({"arrivals": {"kind": "poisson", "rate": math.inf}}, "rate"),
        ({"arrivals": {"kind": "burst", "rate": 1.0}}, "burst"),
        ({"arrivals": {"kind": "poisson", "rate": 1.0, "burst": 2}}, "burst"),
        ({"arrivals": {"kind": "onoff", "rate": 1.0, "on_seconds": 1.0}}, "off_seconds"),
        (
            {
                "arrivals": {
                    "kind": "diurnal",
                    "mean_rate": 1.0,
                    "amplitude": 1.5,
                    "period_seconds": 60,
                }
            },
            "amplitude",
        ),
        ({"arrivals": {"kind": "trace", "trace": "mooncake"}}, "trace"),
        ({"arrivals": {"kind": "trace", "trace": "azure_code", "time_scale": -1}}, "time_scale"),
        (
            {"arrivals": {"kind": "trace", "trace": "azure_code", "offset_seconds": 1e6}},
            "offset_seconds",
        ),
        (
            {
                "arrivals": {
                    "kind": "tenants",
                    "trace": "servegen_language",
                    "clients": 31,
                    "total_rate": 1.0,
                }
            },
            "clients",
        ),
        ({"prompt_tokens": {"kind": "lognormal", "median": 100, "p90": 50, "max": 1000}}, "p90"),
        ({"prompt_tokens": {"kind": "lognormal", "median": 100, "p90": 200, "max": 10}}, "max"),
        ({"output_tokens": {"kind": "fixed", "value": 0}}, "value"),
        ({"prompt_tokens": {"kind": "trace"}}, "prompt_tokens"),
        ({"output_tokens": {"kind": "trace"}}, "output_tokens"),
        ({"sessions": {"count": 0, "skew": 1.0}}, "count"),
        ({"class": None}, "class"),
        ({"name": "has space"}, "name"),
        ({"tenants": "acme"}, "tenants"),
    ],
)
def test_schema_errors_name_the_field(change: dict[str, Any], named: str) -> None:
    spec: dict[str, Any] = {
        "name": "chat",
        "class": "interactive",
        "arrivals": POISSON,
        "prompt_tokens": FIXED,
        "output_tokens": FIXED,
        **change,
    }
    spec = {k: v for k, v in spec.items() if v is not None}
    with pytest.raises(ValidationError) as caught:
        TrafficSource.model_validate(spec)
    assert isinstance(caught.value, ValueError)  # what the scenario loader catches
    # where and what, as the loader reports them (the echoed input does not count)
    described = [" ".join(map(str, e["loc"])) + ": " + e["msg"] for e in caught.value.errors()]
    assert any(named in line for line in described), described


def test_service_class_by_alias_and_by_name() -> None:
    assert source().service_class == "interactive"
    by_name = TrafficSource(
        name="x", service_class="batch", arrivals=POISSON, prompt_tokens=FIXED, output_tokens=FIXED
    )
    assert by_name.service_class == "batch"
    assert by_name.tenant == "default" and by_name.sessions is None


def test_generate_rejects_duplicate_names_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unique"):
        generate([source("a"), source("a")], 10.0, seed=1)
    with pytest.raises(ValueError, match="duration_seconds"):
        generate([source()], 0.0, seed=1)
    with pytest.raises(ValueError, match="seed"):
        generate([source()], 10.0, seed=-1)
