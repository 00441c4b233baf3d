"""The dashboards build, and the JSON committed under dashboards/json/ is what they build."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gpubalance.cli import main
from gpubalance.dashboards import DASHBOARDS
from gpubalance.dashboards.common import render

COMMITTED = Path(__file__).resolve().parents[2] / "dashboards" / "json"
REGENERATE = "gpubalance dashboards build --out dashboards/json"


def test_the_committed_json_is_a_fresh_build(tmp_path: Path) -> None:
    assert main(["dashboards", "build", "--out", str(tmp_path / "out")]) == 0
    built = {p.name: p.read_text() for p in (tmp_path / "out").iterdir()}
    committed = {p.name: p.read_text() for p in COMMITTED.glob("*.json")}
    assert sorted(built) == sorted(f"{name}.json" for name in DASHBOARDS)
    assert sorted(committed) == sorted(built), f"regenerate with: {REGENERATE}"
    for name, text in built.items():
        assert committed[name] == text, f"{name} is stale; regenerate with: {REGENERATE}"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_each_panel_queries_the_chosen_datasource_with_its_own_ids(name: str) -> None:
    model = DASHBOARDS[name]()
    assert model["uid"] == f"gpubalance-{name}"
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in model["panels"]]
    assert len(set(ids)) == len(ids)
    cells: set[tuple[int, int]] = set()  # each panel within the grid's 24 columns, none overlaps
    for panel in model["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not mine & cells, panel["title"]
        cells |= mine
    used = set()
    for panel in model["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["title"] and panel["description"], panel
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs), panel["title"]
        for target in panel["targets"]:
            used.update(re.findall(r"\$(\w+)", target["expr"]))
    # every variable but the datasource filters some panel, and no panel names one not defined
    assert set(variables) - {"datasource"} <= used
    assert used - {"__rate_interval", "__interval"} <= set(variables)


def test_a_model_encodes_to_stable_sorted_json() -> None:
    model = DASHBOARDS["fleet"]()
    text = render(model)
    assert json.loads(text) == model
    assert text == render(json.loads(text)) and text.endswith("\n")


def test_an_output_path_that_is_a_file_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "taken"
    blocker.write_text("")
    assert main(["dashboards", "build", "--out", str(blocker)]) == 2
    assert f"cannot write to {blocker}" in capsys.readouterr().err
