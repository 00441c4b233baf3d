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

from gpubalance.diagnosis import STATES

SUMMARY = re.compile(
    r"^before/after \((\d+) change\(s\) by the controller\): (\d+\.\d\d) s -> (\d+\.\d\d) s p99,"
    r" (\d+)% -> (\d+)% idle while queued$",
    re.M,
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
            "25",
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
        assert any(v[0][1:3] == ("overloaded", "routing_skew") for v in verdicts), panels
        assert re.search(r"^recommend set_weights ", out, re.M), panels[-1]

        # the loop: the controller's changes as they happen, which its audit log holds
        audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
        applied = [e for e in audit if e["decision"] == "applied"]
        assert applied, audit
        shown = re.findall(
            r"^  \d\d:\d\d:\d\d set_weight (be_default/w\d) (\d+) -> (\d+) ", out, re.M
        )
        logged = [(e["target"], str(e["before"]), str(e["after"])) for e in applied]
        assert set(shown) <= set(logged) and logged[-1] in shown, (shown, logged)
        assert all(e["action"] == "set_weight" for e in applied)

        # the one-line summary: the idle-while-queued share the analyzer reads off the
        # exporter falls once the controller re-weighted the pool
        (summary,) = SUMMARY.findall(out)
        changes, _, _, idle_before, idle_after = summary
        assert int(changes) == len(applied)
        assert int(idle_after) < int(idle_before), summary

        # `gpubalance run` stopped its three parts cleanly (SIGTERM, as systemd stops it)
        assert (run_dir / "run.log").read_text().rstrip().endswith("gpubalance run: stopped")
        assert (run_dir / "haproxy.cfg").is_file()
    finally:
        if kept:
            shutil.rmtree(kept.group(1), ignore_errors=True)  # the demo keeps what it names
