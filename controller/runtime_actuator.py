"""Actuator over HAProxy's runtime API: `set server b/s weight N` and `state drain|ready|maint`,
and for a worker's move `add server`, `del server` and `set server addr`.

Needs the socket at `level admin`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gpubalance.controller.actuator import ActuatorError
from gpubalance.controller.haproxy import AdminState, RuntimeApi, RuntimeApiError
from gpubalance.controller.model import Change


class RuntimeApiActuator:
    name = "runtime_api"

    def __init__(self, api: RuntimeApi) -> None:
        self.api = api

    async def apply(self, change: Change) -> None:
        if change.kind == "set_weight":
            assert isinstance(change.value, int)
            await self._call(self.api.set_weight, change.backend, change.server, change.value)
        else:
            assert isinstance(change.value, str)
            await self._call(self.api.set_state, change.backend, change.server, change.value)

    async def set_state(self, backend: str, server: str, state: AdminState) -> None:
        await self._call(self.api.set_state, backend, server, state)

    async def add_server(
        self, backend: str, server: str, host: str, port: int, weight: int
    ) -> None:
        await self._call(self.api.add_server, backend, server, host, port, weight)

    async def del_server(self, backend: str, server: str) -> None:
        await self._call(self.api.del_server, backend, server)

    async def set_addr(self, backend: str, server: str, host: str, port: int) -> None:
        await self._call(self.api.set_addr, backend, server, host, port)

    @staticmethod
    async def _call(method: Callable[..., None], *args: object) -> None:
        try:
            await asyncio.to_thread(method, *args)
        except RuntimeApiError as exc:
            raise ActuatorError(str(exc)) from exc
