"""The one interface every actuator implements: carry out a planned `Change`.

An actuator only acts; what HAProxy shows afterwards is observed in the next pass, never
assumed, so an actuator holds no state the loop relies on.
"""

from __future__ import annotations

from typing import Protocol

from gpubalance.controller.model import Change


class ActuatorError(RuntimeError):
    """The change was not made: the message says why, and the loop retries on a later pass."""


class Actuator(Protocol):
    name: str  # for the audit log: "runtime_api", "agent_check"

    async def apply(self, change: Change) -> None:
        """Carry out `change` or raise `ActuatorError`."""
        ...
