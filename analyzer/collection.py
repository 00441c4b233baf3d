"""Python's cyclic garbage collector paused while a fleet's objects are made."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the while: a fleet's answers, frames and verdicts
    are 10^6 objects, and the collections their making triggers, each scanning every object
    alive, would take as long as the making itself. What is made under it holds no cycle."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
