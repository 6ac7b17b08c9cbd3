"""Shared fixtures of the Python tests: a real sb-planner process per test that asks for one.

The tests import `sparsebalance` from PYTHONPATH (CTest sets it to the build tree's package,
<build>/client/python) and start the planner binary named by $SB_PLANNER (CTest sets it; by
hand: build/server/sb-planner).
"""

import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def planner_binary():
    path = os.environ.get("SB_PLANNER") or str(REPO / "build" / "server" / "sb-planner")
    if not os.access(path, os.X_OK):
        pytest.fail(f"no sb-planner at {path}: build it (cmake --build build --target "
                    "sb-planner) or set SB_PLANNER")
    return path


@pytest.fixture
def planner(tmp_path):
    from sparsebalance.local_planner import LocalPlanner

    p = LocalPlanner(planner_binary(), tmp_path / "state")
    yield p
    p.stop()
