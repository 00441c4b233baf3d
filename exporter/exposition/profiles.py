"""Turn a published view (latest sample + window) into exposition text, per naming profile."""

from __future__ import annotations

from gpubalance.exporter.exposition.dcgm import add_dcgm
from gpubalance.exporter.exposition.native import add_native, add_self, add_serving
from gpubalance.exporter.exposition.text import Exposition
from gpubalance.exporter.view import View

PROFILES = ("native", "dcgm", "both")


def render(view: View, profile: str) -> bytes:
    """The /metrics body for ``profile``: native, dcgm or both. Serving queues and the
    exporter's own health are always there."""
    if profile not in PROFILES:
        raise ValueError(f"unknown naming profile {profile!r}; expected one of {PROFILES}")
    out = Exposition()
    if profile in ("native", "both"):
        add_native(out, view)
    if profile in ("dcgm", "both"):
        add_dcgm(out, view)
    add_serving(out, view)
    add_self(out, view)
    return out.render()
