"""Grafana dashboards as code, built with grafana-foundation-sdk: one module per dashboard.

``gpubalance dashboards build --out DIR`` writes each as JSON; the same JSON is committed under
``dashboards/json/`` for provisioning without Python.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpubalance.dashboards import controller, dcgm, fleet, gpu, host, serving

# file stem -> builder of the dashboard's JSON model
DASHBOARDS: dict[str, Callable[[], dict[str, Any]]] = {
    "fleet": fleet.build,
    "gpu": gpu.build,
    "serving": serving.build,
    "host": host.build,
    "controller": controller.build,
    "dcgm": dcgm.build,
}
