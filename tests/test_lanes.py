"""make test's two lanes (tests/conftest.py): each test carries its group under `--dist loadgroup`.

pytest-xdist tags a test with its group in the test's id; were a pytest release to drop the tag,
the real-clock tests would silently spread over both workers and run beside one another.
"""

from __future__ import annotations

import pytest


def test_a_test_runs_in_its_files_lane_under_make_test(request: pytest.FixtureRequest) -> None:
    if not getattr(request.config.option, "loadgroup", False):  # set on a loadgroup worker
        pytest.skip("make test's lanes: pytest -n 2 --dist loadgroup")
    assert request.node.nodeid.endswith("@tests/test_lanes.py"), request.node.nodeid
