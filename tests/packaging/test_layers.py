"""The parts' import boundaries that ruff's banned-api cannot say per folder.

The analyzer and the controller run on hosts of their own and talk to the exporter over HTTP:
they import the shared types and helpers of ``gpubalance`` (telemetry, diagnosis, config,
webconfig), never the exporter's internals; the controller reads the analyzer's answers as JSON
and imports none of the analyzer either. The dashboards are queries over the metric names
the parts serve and import none of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN = {
    "analyzer": ("gpubalance.exporter",),
    "controller": ("gpubalance.exporter", "gpubalance.analyzer"),
    # the dashboards are queries over served metric names: no part's code
    "dashboards": ("gpubalance.exporter", "gpubalance.analyzer", "gpubalance.controller"),
}


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_a_part_imports_only_the_shared_layers(part: str) -> None:
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / part).rglob("*.py"))
        for name in sorted(imported(path))
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[part])
    ]
    assert not found, "\n".join(found)


def test_the_check_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from gpubalance.exporter.config import X\n")
    assert "gpubalance.exporter.config" in imported(probe)
