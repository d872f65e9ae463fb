"""``--dist loadgroup`` (pyproject's addopts) sends the tests of one ``xdist_group`` to one worker: the PostgreSQL
tests share one server, the bootstrap tests one study storage (``tests/conftest.py``, ``group_node_ids``)."""
from __future__ import annotations

import pytest


@pytest.mark.xdist_group("xdist-groups-check")
def test_a_grouped_tests_node_id_carries_its_group(request: pytest.FixtureRequest) -> None:
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not an xdist worker under --dist loadgroup (-n 0 runs every test in one process)")
    assert request.node.nodeid.endswith("::test_a_grouped_tests_node_id_carries_its_group@xdist-groups-check")
