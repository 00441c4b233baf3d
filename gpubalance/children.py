"""Signal an asyncio child process without taking its exit status from asyncio.

``asyncio.subprocess.Process.send_signal`` (and ``terminate``, ``kill``) go through
``subprocess.Popen.send_signal``, which first polls the child (``waitpid(pid, WNOHANG)``, so as
not to signal a recycled pid). A child that has just exited, but whose exit asyncio's child
watcher has not collected yet, is reaped by that poll: the watcher's own ``waitpid`` then
fails, asyncio logs "Unknown child process pid N, will report returncode 255" and the process's
``returncode`` is 255 instead of its real status. On a busy machine the watcher's thread can
lag the caller by milliseconds, so a part that exits on its own as it is being stopped, or a
child killed and then told to stop, gets the wrong status.

``os.kill`` reaps nothing: the watcher stays the only one to collect the child, and the real
status reaches ``returncode``. The pid is still the child's while ``returncode`` is None, since
only the watcher frees it.
"""

from __future__ import annotations

import os
from typing import Protocol


class Child(Protocol):
    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...


def signal_child(process: Child, sig: int) -> bool:
    """Send ``sig`` to ``process`` unless its exit is known; never reaps it. True when sent."""
    if process.returncode is not None:
        return False
    try:
        os.kill(process.pid, sig)
    except ProcessLookupError:  # exited and already collected, its status on its way
        return False
    return True
