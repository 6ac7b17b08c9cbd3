"""Shared fixtures of the Python tests: a real sb-planner process per test that asks for one.

The tests import `sparsebalance` from PYTHONPATH (CTest sets it to the build tree's package,
<build>/client/python) and start the planner binary named by $SB_PLANNER (CTest sets it; by
hand: build/server/sb-planner).
"""

import os
import pathlib
import signal
import subprocess
import threading

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def planner_binary():
    path = os.environ.get("SB_PLANNER") or str(REPO / "build" / "server" / "sb-planner")
    if not os.access(path, os.X_OK):
        pytest.fail(f"no sb-planner at {path}: build it (cmake --build build --target "
                    "sb-planner) or set SB_PLANNER")
    return path


class Planner:
    """An sb-planner on a free port with its own state directory."""

    def __init__(self, state_dir):
        self.process = subprocess.Popen(
            [planner_binary(), "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
             f"--state_dir={state_dir}", "--drain_seconds=1"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.address = None
        for line in self.process.stdout:
            if "listening on " in line:
                self.address = line.split("listening on ", 1)[1].split()[0].rstrip(";,")
                break
        if self.address is None:
            self.process.kill()
            pytest.fail("sb-planner did not print its address")
        threading.Thread(target=lambda: [None for _ in self.process.stdout], daemon=True).start()

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def planner(tmp_path):
    p = Planner(tmp_path / "state")
    yield p
    p.stop()
