"""Signalling a child never takes its exit status from asyncio's child watcher."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable

import pytest

from gpubalance.children import signal_child


def zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return stat.read().rpartition(b")")[2].split()[0] == b"Z"


def killed_and_uncollected() -> subprocess.Popen[bytes]:
    """A child that has exited and that nobody has collected yet: what asyncio's watcher
    thread sees for a moment after each exit (longer on a busy machine)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not zombie(child.pid):
        assert time.monotonic() < deadline, "the killed child did not exit"
        time.sleep(0.01)
    return child


def test_signalling_an_exited_child_leaves_it_to_its_collector() -> None:
    child = killed_and_uncollected()
    assert signal_child(child, signal.SIGTERM)  # returncode unknown yet: sent
    assert zombie(child.pid)  # not collected: the watcher's waitpid gets the real status
    assert os.waitpid(child.pid, 0)[1] == signal.SIGKILL
    child.returncode = -signal.SIGKILL  # as asyncio's watcher would set it


def test_a_child_known_to_have_exited_is_not_signalled() -> None:
    async def scenario() -> None:
        process = await asyncio.create_subprocess_exec(sys.executable, "-c", "raise SystemExit(3)")
        assert await process.wait() == 3
        assert not signal_child(process, signal.SIGTERM)
        assert process.returncode == 3

    asyncio.run(scenario())


Signal = Callable[[asyncio.subprocess.Process, int], object]


def killed_then_stopped(send: Signal) -> int:
    """SIGKILL a child, then SIGTERM it once it has exited and before asyncio collected it
    (as a test stopping a child it killed does), with ``send``; the status asyncio reports.

    The loop's child watcher here collects in the loop's thread, on SIGCHLD, so the moment
    between the exit and its collection, a few milliseconds at most with the default watcher
    (a thread per child), lasts until the loop runs again."""

    async def scenario() -> int:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import time; time.sleep(60)"
        )
        send(process, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not zombie(process.pid):
            assert time.monotonic() < deadline, "the killed child did not exit"
            time.sleep(0.01)  # blocking: the loop cannot collect the exit meanwhile
        send(process, signal.SIGTERM)
        return await process.wait()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        policy = asyncio.get_event_loop_policy()
        before = policy.get_child_watcher()
        policy.set_child_watcher(asyncio.SafeChildWatcher())
    try:
        return asyncio.run(scenario())
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            policy.set_child_watcher(before)


@pytest.mark.skipif(
    not hasattr(asyncio, "SafeChildWatcher"), reason="this Python has no SafeChildWatcher"
)
def test_a_killed_then_stopped_asyncio_child_reports_the_kill() -> None:
    assert killed_then_stopped(signal_child) == -signal.SIGKILL
    # the library's signal collects the exit first; asyncio then reports 255 (the failure
    # this helper fixes: "Unknown child process pid N, will report returncode 255")
    assert killed_then_stopped(lambda process, sig: process.send_signal(sig)) == 255
