"""bench/analyzer.py's path, small: a fleet backfilled into a real Prometheus with promtool, and
the fleet diagnosis from it finds the states the lab planted on every GPU.

Six hosts of 8 GPUs, four minutes scraped every 5 s: one host of each kind the benchmark's
fleet mixes (balanced; two GPUs overloaded by a skewed router while six starve; all starved
for want of demand; all overloaded for want of capacity), through the exporter's own
exposition, ``promtool tsdb create-blocks-from openmetrics`` and a ``prometheus`` serving the
blocks: what ``make bench`` measures at 1,000 hosts.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOSTS = 6  # the first six hosts take every kind of host of bench/analyzer.py's fleet
SECONDS = 240.0
SCRAPE_SECONDS = 5.0
WINDOWS = 6  # the last six of the run's eight: the exporter's window figures are full

pytestmark = [
    pytest.mark.skipif(
        shutil.which("prometheus") is None or shutil.which("promtool") is None,
        reason="apt-get install prometheus",
    ),
    pytest.mark.timeout(600),
]


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_analyzer", ROOT / "bench" / "analyzer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_analyzer"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bench = _bench_module()


def test_a_backfilled_fleet_is_diagnosed_as_the_lab_planted_it(tmp_path: Path) -> None:
    runs = bench.runs_for(seeds=1, seconds=SECONDS, scrape_seconds=SCRAPE_SECONDS)
    built = bench.build_tsdb(tmp_path, HOSTS, runs)
    assert built["samples"] > 0 and not (tmp_path / "fleet.om").exists()
    end = bench.T0 + SECONDS
    with bench.prometheus(tmp_path / "tsdb") as server:
        timed = bench.diagnose(server, end - WINDOWS * bench.WINDOW_SECONDS, end)
        cycle = bench.service_cycle(server, end - WINDOWS * bench.WINDOW_SECONDS, end)
    # the skewed host's pool is re-weighted, at least
    assert cycle["gpu_windows"] == HOSTS * 8 * WINDOWS and cycle["recommendations"] >= 1
    assert timed.gpu_windows == HOSTS * 8 * WINDOWS
    assert set(timed.seconds) == set(bench.STAGES)
    agree, planted, wrong = bench.agreement(timed, HOSTS, runs)
    assert sum(planted.values()) == HOSTS * 8 * WINDOWS, "a verdict without a planted state"
    assert set(planted) == {"balanced", "starved", "overloaded"}
    assert wrong == Counter(), f"{agree} verdicts as planted; planted -> given: {wrong}"
    kinds = Counter(f.kind for f in timed.fleet)
    # the skewed host's pool is an imbalance, the idle one over-provisioned, the short one
    # short of capacity, the balanced ones balanced
    assert set(kinds) == {"balanced", "imbalance", "over_provisioning", "capacity_shortage"}
