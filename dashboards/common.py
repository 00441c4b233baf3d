"""What every gpubalance dashboard shares: the datasource, the template variables, panels.

Queries use raw expressions over the metrics gpubalance serves (no recording rules), so a
dashboard works against any Prometheus that scrapes the exporter, analyzer and controller.
Filters are regular expressions (``=~"$host"``) because each variable may be "All".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from grafana_foundation_sdk.builders import dashboard, prometheus, statetimeline, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import VisibilityMode
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    DataTransformerConfig,
    DynamicConfigValue,
    ValueMap,
    ValueMappingResult,
    VariableOption,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
TAGS = ["gpubalance"]
GRID_COLUMNS = 24  # the width of Grafana's dashboard grid
# what "All" stands for in every filter: any value, the empty one too (a serving queue that
# is not mapped to a GPU has gpu="")
ALL = ".*"


def query(expr: str, legend: str = "__auto", *, instant: bool = False) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).legend_format(legend).datasource(DATASOURCE)
    return q.instant() if instant else q.range()


def datasource_variable() -> dashboard.DatasourceVariable:
    return dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")


def label_variable(
    name: str, label: str, metric: str, source_label: str, *, numeric: bool = False
) -> dashboard.QueryVariable:
    """A variable holding the values of ``source_label`` on ``metric`` (with "All")."""
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        # the classic string form: every Grafana version reads it, where the editor's object
        # forms changed between versions
        .query(f"label_values({metric}, {source_label})")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.NUMERICAL_ASC if numeric else VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(ALL)
        .current(VariableOption(text="All", value="$__all", selected=True))
    )


def new_dashboard(uid: str, title: str, description: str) -> dashboard.Dashboard:
    return (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(datasource_variable())
    )


def series(
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    unit: str,
    *,
    width: int = 12,
    minimum: float | None = 0,
    maximum: float | None = None,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(8)
    )
    if minimum is not None:
        panel = panel.min(minimum)
    if maximum is not None:
        panel = panel.max(maximum)
    for target in targets:
        panel = panel.with_target(target)
    return panel


def states(
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    mapping: dict[str, tuple[str, str]],
    *,
    width: int = 24,
) -> statetimeline.Panel:
    """A state timeline whose values ``mapping`` names: value -> (text, colour)."""
    panel = (
        statetimeline.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(width)
        .height(8)
        .show_value(VisibilityMode.NEVER)
        .mappings(
            [
                ValueMap(
                    options={
                        value: ValueMappingResult(text=text, color=colour, index=i)
                        for i, (value, (text, colour)) in enumerate(mapping.items())
                    }
                )
            ]
        )
    )
    for target in targets:
        panel = panel.with_target(target)
    return panel


def listing(
    title: str,
    description: str,
    columns: Sequence[tuple[str, str, str]],
    *,
    width: int = 24,
) -> table.Panel:
    """A table of the series' current values: one row per label set, one column per query.

    ``columns``: (expression, column name, unit) each. The queries must give the same labels,
    so that Grafana's merge transformation lines their values up in one row.
    """
    panel = (
        table.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(width)
        .height(8)
    )
    names = {}
    for i, (expr, name, unit) in enumerate(columns):
        ref = chr(ord("A") + i)
        panel = panel.with_target(
            query(expr, instant=True).format(PromQueryFormat.TABLE).ref_id(ref)
        )
        value = f"Value #{ref}" if len(columns) > 1 else "Value"
        names[value] = name
        # overrides apply after the transformations: to the renamed column
        panel = panel.override_by_name(name, [DynamicConfigValue(id_val="unit", value=unit)])
    if len(columns) > 1:
        panel = panel.with_transformation(DataTransformerConfig(id_val="merge", options={}))
    return panel.with_transformation(
        DataTransformerConfig(
            id_val="organize",
            options={"excludeByName": {"Time": True, "job": True}, "renameByName": names},
        )
    )


def finish(board: dashboard.Dashboard) -> dict[str, Any]:
    """The dashboard's JSON model, with the panel ids and query refIds Grafana expects."""
    model: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    x = y = row_height = 0
    for number, panel in enumerate(model["panels"], start=1):
        panel["id"] = number
        # left to right, a new row when the panel does not fit (the SDK's own placement puts a
        # full-width panel beside a half-width one)
        width, height = panel["gridPos"]["w"], panel["gridPos"]["h"]
        if x + width > GRID_COLUMNS:
            x, y, row_height = 0, y + row_height, 0
        panel["gridPos"] = {"h": height, "w": width, "x": x, "y": y}
        x, row_height = x + width, max(row_height, height)
        for i, target in enumerate(panel.get("targets", [])):
            target["refId"] = chr(ord("A") + i)
    return model


def render(model: dict[str, Any]) -> str:
    """Stable text of a dashboard: what is committed under dashboards/json/."""
    return json.dumps(model, indent=2, sort_keys=True) + "\n"
