"""Actuator as an HAProxy agent-check responder: weights and states without the admin socket.

HAProxy connects to the responder every `agent-inter`, sends the server's `agent-send` string,
and reads one line back: `75%` (of the server's configured weight), `drain`, `ready` or
`maint`, or both (`75% ready`). Each server line names itself, e.g.

    server s1 10.0.0.5:8000 weight 100 agent-check agent-addr 127.0.0.1 agent-port 9471 \\
        agent-send "be/s1\\n" agent-inter 2s

so one responder answers every server. A server it has no word for gets an empty line, which
HAProxy ignores: after a restart the responder says nothing until the loop, having observed
HAProxy again, decides otherwise. The weight is a whole percentage of the configured weight, so
it lands exactly when that weight is 100 or less.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass
from typing import cast

from gpubalance.controller.actuator import ActuatorError
from gpubalance.controller.haproxy import ADMIN_STATES, MAX_WEIGHT, AdminState
from gpubalance.controller.model import Change

log = logging.getLogger("gpubalance.controller")

_READ_TIMEOUT_SECONDS = 2.0
_MAX_REQUEST_BYTES = 256


@dataclass(slots=True)
class _Word:
    weight_percent: int | None = None
    state: AdminState | None = None

    def reply(self) -> str:
        parts = []
        if self.weight_percent is not None:
            parts.append(f"{self.weight_percent}%")
        if self.state is not None:
            parts.append(self.state)
        return " ".join(parts)


def weight_percent(weight: int, initial_weight: int | None) -> int:
    """The agent's percentage that HAProxy turns into `weight` (it rounds down)."""
    if not initial_weight:
        raise ActuatorError(
            "agent-check weights are a percentage of the configured weight, which is 0 here; "
            "set a configured weight or use the runtime API"
        )
    percent = math.ceil(weight * 100 / initial_weight)
    if initial_weight * percent // 100 != weight or initial_weight * percent // 100 > MAX_WEIGHT:
        raise ActuatorError(
            f"weight {weight} is not a whole percentage of the configured weight "
            f"{initial_weight}; agent-check can set it only in steps of {initial_weight / 100}"
        )
    return percent


class AgentCheckResponder:
    """A TCP server HAProxy's agent checks poll; `apply` changes what it answers."""

    name = "agent_check"

    def __init__(self) -> None:
        self._words: dict[str, _Word] = {}
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._answer, host, port)
        return self._server.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def reply_for(self, key: str) -> str:
        word = self._words.get(key)
        return word.reply() if word is not None else ""

    async def apply(self, change: Change) -> None:
        word = self._words.setdefault(change.key, _Word())
        if change.kind == "set_weight":
            assert isinstance(change.value, int)
            word.weight_percent = weight_percent(change.value, change.initial_weight)
        else:
            assert change.value in ADMIN_STATES
            word.state = cast(AdminState, change.value)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_READ_TIMEOUT_SECONDS):
                line = await reader.readline()
            key = line[:_MAX_REQUEST_BYTES].decode(errors="replace").strip()
            writer.write((self.reply_for(key) + "\n").encode())
            await writer.drain()
        except (TimeoutError, ConnectionError) as exc:
            log.debug("agent check from %s: %s", writer.get_extra_info("peername"), exc)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
