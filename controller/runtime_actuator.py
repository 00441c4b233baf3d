"""Actuator over HAProxy's runtime API: `set server b/s weight N` and `state drain|ready|maint`.

Needs the socket at `level admin`.
"""

from __future__ import annotations

import asyncio

from gpubalance.controller.actuator import ActuatorError
from gpubalance.controller.haproxy import RuntimeApi, RuntimeApiError
from gpubalance.controller.model import Change


class RuntimeApiActuator:
    name = "runtime_api"

    def __init__(self, api: RuntimeApi) -> None:
        self.api = api

    async def apply(self, change: Change) -> None:
        try:
            if change.kind == "set_weight":
                assert isinstance(change.value, int)
                await asyncio.to_thread(
                    self.api.set_weight, change.backend, change.server, change.value
                )
            else:
                assert isinstance(change.value, str)
                await asyncio.to_thread(
                    self.api.set_state, change.backend, change.server, change.value
                )
        except RuntimeApiError as exc:
            raise ActuatorError(str(exc)) from exc
