"""Helpers for the deploy/ tests: start sb-planner on free loopback ports, drive it with traffic,
fetch over HTTP, and stop every process started, whatever happens (Python standard library only).

    with Processes() as procs:
        planner = start_planner(procs, "build/server/sb-planner", state_dir)
        generate_traffic(procs, "build/bench/sb-load", planner.grpc, steps=100)
"""
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

SKIPPED = 77  # CTest's SKIP_RETURN_CODE for these tests


def skip(why):
    print(f"SKIPPED: {why}")
    sys.exit(SKIPPED)


def fail(why):
    print(f"FAILED: {why}")
    sys.exit(1)


def finish(failures, summary):
    """Fails listing every failure, or prints the one-line summary of a passing check."""
    if failures:
        fail("\n  " + "\n  ".join(failures))
    print(summary)


def find_tool(name, hint):
    path = shutil.which(name)
    if path is None:
        skip(f"{name} not found ({hint})")
    return path


def free_port():
    """A loopback port that was free a moment ago (for programs that cannot take port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read().decode()


class Processes:
    """Starts processes and, on exit, stops each (SIGTERM, then SIGKILL after 5 s), newest first."""

    def __init__(self):
        self.started = []

    def start(self, args, **kwargs):
        proc = subprocess.Popen(args, **kwargs)
        self.started.append(proc)
        return proc

    def stop(self, proc):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for proc in reversed(self.started):
            self.stop(proc)
        return False


class Planner:
    def __init__(self, proc, grpc, metrics):
        self.proc = proc
        self.grpc = grpc  # host:port
        self.metrics = metrics  # host:port of /metrics


def read_line(proc, deadline_s, what):
    """The next line of proc's stdout, waiting at most deadline_s seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], deadline_s)
    if not ready:
        fail(f"{what} printed nothing within {deadline_s} s")
    line = proc.stdout.readline()
    if not line:
        fail(f"{what} exited (code {proc.wait()}) before saying where it listens")
    return line


def start_planner(procs, args, what="sb-planner", env=None):
    """Starts sb-planner (args: its command line, which must choose ports itself, port 0 or
    fixed) and reads the addresses it prints."""
    proc = procs.start(args, stdout=subprocess.PIPE, text=True, env=env)
    line = read_line(proc, 15, what)
    found = re.search(r"listening on (\S+) .*metrics on http://(\S+)/metrics", line)
    if not found:
        fail(f"{what} said {line!r}, expected 'listening on H:P ... metrics on http://H:P/metrics'")
    return Planner(proc, found.group(1), found.group(2))


def planner_args(binary, state_dir):
    return [binary, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
            f"--state_dir={state_dir}", "--drain_seconds=1"]


# ---------------------------------------------------------------------------------------------
# TRAFFIC: the "short worker run" the deploy tests observe. Today it is sb-load's soak scenario
# (one job of `ranks` ranks: SubmitBatch, every rank's GetRankPlan and ReportStep, step after
# step), with --keep_jobs so that the job and its per-job series stay after the run. When
# sb-worker exists, swap it in here; nothing else in the tests depends on which program it is.
# ---------------------------------------------------------------------------------------------
def generate_traffic(procs, sb_load, planner_grpc, steps, ranks=8, sb_run=None, out_dir=None):
    """Starts the traffic against planner_grpc and returns its process (running in the
    background; wait for it or let Processes stop it). With sb_run: a short worker run (real
    sb-worker ranks running the CPU kernels on a tiny model, jobs kept so that their series
    stay); otherwise sb-load's soak."""
    if sb_run:
        return procs.start([sb_run, f"--planner={planner_grpc}", "--workers=2",
                            f"--steps={steps}", "--profile=none", "--keep_jobs",
                            "--policies=sparsebalance", "--layers=1", "--heads=1",
                            "--head_dim=64", "--capacity=2048", f"--out={out_dir}"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return procs.start([sb_load, f"--planner={planner_grpc}", "--scenario=soak",
                        f"--soak_steps={steps}", f"--soak_ranks={ranks}", "--keep_jobs"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


class Deadline:
    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self):
        return self.end - time.monotonic()

    def check(self, what):
        if self.left() <= 0:
            fail(f"time is up while {what}")


def repo_root():
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
