"""An ``sb-planner`` process on this machine, for examples, tests and single-node trials.

    from sparsebalance.local_planner import LocalPlanner
    with LocalPlanner("build/server/sb-planner") as planner:
        balancer = Balancer(planner.address, lengths)

It listens on a free loopback port (gRPC and metrics), keeps its state in ``state_dir`` (a
temporary directory removed at stop when not given) and is stopped with SIGTERM (then killed
after 20 s) by ``stop()`` or at the end of the ``with`` block.
"""

import os
import signal
import subprocess
import tempfile
import threading


class LocalPlanner:
    """Starts ``binary`` (an sb-planner executable); ``address`` is its host:port and
    ``metrics_url`` its Prometheus page (``http://host:port/metrics``). Raises
    FileNotFoundError when ``binary`` is not executable and RuntimeError when the planner does
    not print the address it listens on."""

    def __init__(self, binary, state_dir=None):
        binary = os.fspath(binary)
        if not os.access(binary, os.X_OK):
            raise FileNotFoundError(f"binary: no executable sb-planner at {binary} (build it with "
                                    "cmake --build build --target sb-planner)")
        self._temporary = None
        if state_dir is None:
            self._temporary = tempfile.TemporaryDirectory(prefix="sb-planner-")
            state_dir = self._temporary.name
        self.process = subprocess.Popen(
            [binary, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
             f"--state_dir={os.fspath(state_dir)}", "--drain_seconds=1",
             # No load balancer watches a local planner's health: no notice before the drain.
             "--drain_notice_seconds=0"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.address = None
        self.metrics_url = None
        for line in self.process.stdout:
            if "listening on " in line:
                self.address = line.split("listening on ", 1)[1].split()[0].rstrip(";,")
                if "metrics on " in line:
                    self.metrics_url = line.split("metrics on ", 1)[1].split()[0].rstrip(";,")
                break
        if self.address is None:
            self.process.kill()
            self.process.wait()
            self._cleanup()
            raise RuntimeError(f"{binary} did not print the address it listens on")
        # Keep reading its output so that the pipe never fills and blocks it.
        threading.Thread(target=lambda: [None for _ in self.process.stdout], daemon=True).start()

    def stop(self):
        """SIGTERM, then SIGKILL after 20 s; removes a temporary state directory."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._cleanup()

    def _cleanup(self):
        if self._temporary is not None:
            self._temporary.cleanup()
            self._temporary = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False
