"""`make demo` in a pipe: 4 GPUs (3x RTX 4090 + RTX 3090) with values that move, the analyzer's
verdicts, and `gpubalance run --act` fixing the skewed server through the lab's real HAProxy.

One live run serves every assertion: the demo is among the suite's slowest tests.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpubalance.controller.model import Settings
from gpubalance.diagnosis import STATES
from gpubalance.lab.demo import Latencies, LoopPanel, p99_between

SUMMARY = re.compile(
    r"^before/after \((\d+) change\(s\) by the controller\): (\d+\.\d\d) s -> (\d+\.\d\d) s p99,"
    r" (\d+)% -> (\d+)% idle while queued$",
    re.M,
)


INF = float("inf")
BOUNDS = (0.5, 1.0, 2.5, INF)
ZERO = Latencies(0.0, BOUNDS, ((0, 0, 0, 0), (0, 0, 0, 0)))


def test_p99_is_interpolated_in_its_bucket_as_histogram_quantile_does() -> None:
    # worker 0: 50 requests under 0.5 s, 40 more under 1 s, 10 more under 2.5 s
    last = Latencies(10.0, BOUNDS, ((50, 90, 100, 100), (0, 0, 0, 0)))
    # the 99th of 100 lies 9/10 of the way through the (1, 2.5] bucket
    assert p99_between(ZERO, last) == (pytest.approx(1.0 + 1.5 * 0.9), 100)
    assert p99_between(ZERO, last, worker=1) == (None, 0)
    # beyond the largest bound only that bound is known, as histogram_quantile says
    slow = Latencies(10.0, BOUNDS, ((0, 0, 0, 0), (0, 0, 90, 100)))
    assert p99_between(ZERO, slow) == (2.5, 100)
    # only what was completed between the two readings counts
    assert p99_between(last, last) == (None, 0)


def test_the_panel_splits_the_run_at_the_controllers_first_and_last_change(tmp_path) -> None:
    panel = LoopPanel([], tmp_path / "audit.jsonl")
    # 10 requests a second: under 0.5 s before the changes at t=20 and t=22, under 1 s after
    for t in range(41):
        fast, slow = min(t, 20) * 10, max(0, t - 20) * 10
        total = fast + slow
        counts = ((fast, total, total, total), (0, 0, 0, 0))
        panel.readings.append(Latencies(float(t), BOUNDS, counts))
    panel.entries = [
        {"decision": "waiting", "at_seconds": 19.0},
        {"decision": "applied", "at_seconds": 20.0},
        {"decision": "applied", "at_seconds": 22.0},
    ]
    # the analyzer's windows: (start, end, idle-while-queued)
    panel.windows = [(0.0, 10.0, 0.6), (10.0, 20.0, 0.4), (20.0, 30.0, 0.2), (30.0, 40.0, 0.0)]
    before, after = panel.before(), panel.after()
    assert before is not None and after is not None
    assert (before.start_seconds, before.end_seconds, before.requests) == (0.0, 20.0, 200)
    assert before.p99_seconds == pytest.approx(0.495)
    assert before.idle_while_queued_ratio == pytest.approx(0.5)
    # the latest 10 s, all after the last change; the windows that began after it
    assert (after.start_seconds, after.end_seconds, after.requests) == (30.0, 40.0, 100)
    assert after.p99_seconds == pytest.approx(0.995)
    assert after.idle_while_queued_ratio == 0.0
    assert panel.summary() == (
        "before/after (2 change(s) by the controller): 0.49 s -> 0.99 s p99, "
        "50% -> 0% idle while queued"
    )


@pytest.mark.live
def test_demo_shows_the_gpus_the_verdicts_and_the_loop_fixing_the_skew(
    fakenvml_dir: Path, tmp_path: Path
) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpubalance",
            "lab",
            "demo",
            "--duration",
            "40",
            "--build-dir",
            str(fakenvml_dir),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    kept = re.search(r"remove them with: rm -r (\S+)", result.stdout)
    try:
        assert result.returncode == 0, result.stderr
        assert kept, "the demo names the run directory it keeps"
        run_dir = Path(kept.group(1))
        out = result.stdout
        assert re.search(r"analyzer: http://127\.0\.0\.1:\d+/api/v1/diagnosis", out)
        assert re.search(r"controller: http://127\.0\.0\.1:\d+/metrics", out)

        # the exporter's table: four GPUs, values that move between refreshes
        rows = re.findall(r"│ (\d)\s+│ (RTX \d{4})\s+│[^│]*│[^│]*│[^│]*│[^│]*│ (\d+)/\d+ W", out)
        frames = [rows[i : i + 4] for i in range(0, len(rows), 4)]
        assert len(frames) >= 3, out
        assert [(gpu, model) for gpu, model, _ in frames[0]] == [
            ("0", "RTX 4090"),
            ("1", "RTX 4090"),
            ("2", "RTX 4090"),
            ("3", "RTX 3090"),
        ]
        assert len({tuple(power for _, _, power in frame) for frame in frames}) > 1

        # the analyzer's panel: each GPU's verdict; the card the weighted round robin sends
        # most requests to is overloaded by the routing until the controller re-weights it
        panels = [p.split("loop · ")[0] for p in out.split("analyzer · ")[1:]]
        assert panels, out
        verdicts = [
            re.findall(r"│ (\d)\s+│ (\w+)\s+│ (\w+|-)\s+│ (\d\.\d\d) │", panel) for panel in panels
        ]
        assert all([gpu for gpu, *_ in v] == ["0", "1", "2", "3"] for v in verdicts), panels[-1]
        assert all(state in STATES for v in verdicts for _, state, _, _ in v)
        audit_log = run_dir / "audit.jsonl"
        lines = audit_log.read_text().splitlines() if audit_log.exists() else []
        applied = [e for e in map(json.loads, lines) if e["decision"] == "applied"]

        # the controller starts paused and plans; the demo resumes it, as a person would, and
        # it acts only after that
        decisions = [json.loads(line)["decision"] for line in lines]
        assert decisions[0] == "paused" and decisions.count("resumed") == 1, decisions
        assert "applied" not in decisions[: decisions.index("resumed")], decisions
        assert "loop · gpubalance run --act --paused: the controller plans and waits" in out
        assert "  paused; " in out, out[:4000]
        if not applied:
            # On a machine whose other core is busy the lab's workers share it, the whole
            # server runs near full, and no peer idles for the routing within the run: the
            # analyzer sees no skew and the demo must say that nothing was changed. (The loop
            # fixing the skew is held at the fast speed by tests/lab/test_loop_bench.py.)
            assert "before/after: the controller made no change" in out, out[-2000:]
        else:
            # the analyzer saw the skew: the default target overloaded by the routing, or (as
            # the controller may re-weight before the target's queue has held long enough for
            # that verdict) its peers starved by it
            assert any(
                v[0][1:3] == ("overloaded", "routing_skew")
                or any(peer[1:3] == ("starved", "routing_skew") for peer in v[1:])
                for v in verdicts
            ), panels
            assert re.search(r"^recommend set_weights ", out, re.M), panels[-1]

            # the loop: the controller's changes as they happen, and all of them once it stops
            # (one may land after the panel's last refresh), as its audit log holds them
            change = re.compile(
                r"^  \d\d:\d\d:\d\d set_weight (be_default/w\d) (\d+) -> (\d+) ", re.M
            )
            shown = change.findall(out)
            logged = [(e["target"], str(e["before"]), str(e["after"])) for e in applied]
            assert set(shown) == set(logged), (shown, logged)
            listing = out.split(f"controller: {len(applied)} change(s) applied (")[-1]
            assert change.findall(listing) == logged, listing
            assert all(e["action"] == "set_weight" for e in applied)
            # what the controller did, as HAProxy held it: each change starts from the weight
            # the one before it on that server left (the controller reads HAProxy back, and
            # nothing else touched it), moves by at most the guard's default step, and cites
            # the recommendation it carries out; the skewed card's share of the pool's weight falls
            # from the scenario's 8/2/2/1. Not held: the order the RTX 3090 ends in against the
            # 4090s. By the lab's batch times it serves 78 % of a 4090's requests in batches of
            # one and 44 % in full batches of 8 for this work, but the live workers' batches
            # take wall time, and on a loaded machine (four tests at a time beside a busy core)
            # they wait for a core, so the capacities the analyzer measures from them read the
            # three 4090s 9 % apart (87, 80 and 81 in one run of 30 rounds) and the 3090 above
            # every 4090 (79 against 72 in another). The fast speed, where time is simulated,
            # holds each card's fitted ρ: tests/analyzer/test_capacity.py.
            start = {f"be_default/w{i}": w for i, w in enumerate((100, 25, 25, 12))}
            step = Settings().max_weight_step
            final = dict(start)
            for e in applied:
                assert e["before"] == final[e["target"]], (e, final)
                assert 0 < abs(e["after"] - e["before"]) <= step, e
                assert e["recommendation"], e
                final[e["target"]] = e["after"]
            skewed = "be_default/w0"
            assert final[skewed] / sum(final.values()) < start[skewed] / sum(start.values()), final

            # the one-line summary: the p99 the workers report or the idle-while-queued share
            # the analyzer reads off the exporter falls once the controller re-weighted the
            # pool. Not both every time: with the other core busy, the live lab's workers wait
            # for a core, their GPUs idle while work queues whatever the weights, and the
            # idle share may not fall within the demo's 25 s while the p99 does (seen once in
            # 12 runs four at a time beside a busy core: 2.47 -> 1.84 s, 52% -> 56%).
            # (When the last change lands in the run's final seconds no reading follows it,
            # and the line says so with n/a rather than figures.)
            summaries = SUMMARY.findall(out)
            if summaries:
                ((changes, p99_before, p99_after, idle_before, idle_after),) = summaries
                assert int(changes) == len(applied)
                if int(idle_before) > 0:
                    assert int(idle_after) < int(idle_before) or float(p99_after) < float(
                        p99_before
                    ), summaries
                else:
                    # with the other core busy the workers share one, every queue holds work
                    # and no peer idled before the change (the analyzer saw the skew in the
                    # queues): nothing to fall, and the change must not make a GPU idle
                    assert int(idle_after) == 0, summaries
            else:
                assert re.search(r"^before/after", out, re.M), out[-2000:]

        # `gpubalance run` stopped its three parts cleanly (SIGTERM, as systemd stops it)
        assert (run_dir / "run.log").read_text().rstrip().endswith("gpubalance run: stopped")
        assert (run_dir / "haproxy.cfg").is_file()
    finally:
        if kept:
            shutil.rmtree(kept.group(1), ignore_errors=True)  # the demo keeps what it names
