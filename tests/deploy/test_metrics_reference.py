"""docs/metrics.md: what `gpubalance docs metrics` writes, and every metric a real scrape of the
exporter, the analyzer or the controller shows is in it, with its labels."""

from __future__ import annotations

import re
from pathlib import Path

from deploy_harness import ROOT, Scrapes

from gpubalance.cli import main
from gpubalance.metrics_reference import DCGM_NAMES, all_metrics, markdown, parse_exposition

REFERENCE = ROOT / "docs" / "metrics.md"
ROW = re.compile(r"^\| `(?P<name>[^`]+)` \| (?P<kind>\w+) \| (?P<labels>[^|]*) \|", re.MULTILINE)


def documented() -> dict[str, tuple[str, set[str]]]:
    """name -> (type, label names) as docs/metrics.md lists them."""
    return {
        m["name"]: (m["kind"], set(re.findall(r"`([^`]+)`", m["labels"])))
        for m in ROW.finditer(REFERENCE.read_text())
    }


def test_the_committed_reference_is_what_the_command_writes(tmp_path: Path) -> None:
    out = tmp_path / "metrics.md"
    assert main(["docs", "metrics", "--out", str(out)]) == 0
    assert out.read_text() == markdown(all_metrics())
    assert out.read_text() == REFERENCE.read_text(), "run: gpubalance docs metrics"


def test_every_dcgm_name_pairs_a_native_series_with_one_the_dcgm_profile_serves() -> None:
    metrics = all_metrics()
    native = {m.name for m in metrics if m.process == "exporter"}
    dcgm = {m.name for m in metrics if m.process == "exporter --names dcgm"}
    paired = {name for names in DCGM_NAMES.values() for name in names.split(", ")}
    assert set(DCGM_NAMES) <= native
    assert paired == dcgm, (
        f"DCGM fields no native series names: {sorted(dcgm - paired)}; "
        f"names the DCGM profile does not serve: {sorted(paired - dcgm)}"
    )


def test_every_metric_a_real_scrape_shows_is_in_the_reference(scrapes: Scrapes) -> None:
    listed = documented()
    for process, text in scrapes.texts.items():
        served = parse_exposition(text, process)
        assert len(served) >= 5, f"{process}: a scrape this small proves little:\n{text}"
        for metric in served:
            assert metric.name in listed, f"{process} serves {metric.name}, not in {REFERENCE}"
            kind, labels = listed[metric.name]
            assert metric.kind == kind, f"{metric.name}: served as {metric.kind}, listed {kind}"
            assert set(metric.labels) <= labels, (
                f"{metric.name}: served with labels {metric.labels}, listed {sorted(labels)}"
            )
