"""Cross-process locks that a crash cannot leave taken: advisory file locks (flock(2)).

The live workers share the host's cores, its disk and each GPU. The kernel drops a process's
flock locks when the process dies, so a worker killed while holding its GPU (the lab's crash
event) frees it as a real GPU context is freed, where a multiprocessing lock would stay taken
forever. Every acquisition opens its own file description: flock locks belong to it, so two
threads of one process cannot both pass on one descriptor.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

_POLL_SECONDS = (0.0005, 0.001, 0.002)  # back-off while every core is taken


class FileLock:
    """One holder at a time (a GPU, the disk)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        Path(self.path).touch(exist_ok=True)

    def acquire(self) -> int:
        fd = os.open(self.path, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    @staticmethod
    def release(fd: int) -> None:
        os.close(fd)  # closing the description drops the lock


class FileSemaphore:
    """``slots`` holders at a time (the host's cores): one lock file per slot."""

    def __init__(self, directory: str | Path, slots: int) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.paths = [str(directory / f"slot-{i}") for i in range(slots)]
        for path in self.paths:
            Path(path).touch(exist_ok=True)

    def acquire(self) -> int:
        attempt = 0
        while True:
            for path in self.paths:
                fd = os.open(path, os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return fd
                except BlockingIOError:
                    os.close(fd)
            time.sleep(_POLL_SECONDS[min(attempt, len(_POLL_SECONDS) - 1)])
            attempt += 1

    @staticmethod
    def release(fd: int) -> None:
        os.close(fd)
