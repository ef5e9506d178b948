"""The tests of one ``xdist_group`` run on one worker under ``make test`` (``-n 2``, pyproject's
``--dist loadgroup``), so the fixtures a group shares are made once (tests/conftest.py, Note: xdist groups)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xdist_group("xdist-groups")


def test_a_grouped_test_carries_its_group_to_the_scheduler(request: pytest.FixtureRequest) -> None:
    if not hasattr(request.config, "workerinput") or not request.config.getvalue("loadgroup"):
        pytest.skip("only under xdist with --dist loadgroup (make test: pytest -n 2)")
    # The scheduler groups by this suffix; without it the group's tests are spread over the workers.
    assert request.node.nodeid.endswith("@xdist-groups"), request.node.nodeid
