"""After each controller test: no worker of this lane's tests left running (see
`controller_harness.kill_workers`); one left is killed, and the test that left it is named."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
from controller_harness import kill_workers, lane_mark


@pytest.fixture(autouse=True)
def no_worker_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    left = kill_workers(lane_mark())
    if left:
        warnings.warn(
            f"{request.node.nodeid} left workers running (killed): {'; '.join(left)}",
            stacklevel=1,
        )
