"""examples/pytorch/train.py end to end: four gloo ranks train a DDP model with FlexAttention
on the planner's block masks against a real sb-planner and the loss goes down; with the planner
unreachable the run refuses to start unless --offline, and then trains on local plans; and the
example's SparseBalance lines are the ten marked ones."""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from conftest import REPO  # noqa: E402

EXAMPLE = REPO / "examples" / "pytorch" / "train.py"
RANKS = 4


def run_example(tmp_path, *flags, timeout=400, check=True):
    out = tmp_path / "steps.jsonl"
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), f"--ranks={RANKS}", "--eval_docs=0", f"--out={out}",
         *flags],
        capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    if check:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return result, lines


def test_trains_with_a_real_planner(planner, tmp_path):
    steps = 8
    result, lines = run_example(tmp_path, f"--planner={planner.address}", f"--steps={steps}")
    assert sorted((l["step"], l["rank"]) for l in lines) == \
        [(s, r) for s in range(steps) for r in range(RANKS)]
    assert not any(l["local"] for l in lines)
    assert "reports delivered: True" in result.stdout  # every report reached the planner
    for l in lines:
        assert all(0 < d <= 1 for d in l["densities"]) and l["plan_wait_seconds"] >= 0
    # The planner sparsified some documents (the job's default density is below 1).
    assert min(d for l in lines for d in l["densities"]) < 1
    loss = [next(l["loss"] for l in lines if l["step"] == s and l["rank"] == 0)
            for s in range(steps)]
    # All ranks agree on the global loss of a step (it is all-reduced).
    assert all(abs(l["loss"] - loss[l["step"]]) < 1e-6 for l in lines)
    # From ln(64) ~ 4.16 at the start, well down within a few steps.
    assert sum(loss[-3:]) / 3 < sum(loss[:2]) / 2 - 0.3, loss


def test_by_node_the_nodes_first_rank_takes_its_plans_and_sends_its_reports(planner, tmp_path):
    # The four ranks share this machine's host name: one node, led by rank 0.
    steps = 4
    result, lines = run_example(tmp_path, f"--planner={planner.address}", f"--steps={steps}",
                                "--by_node")
    assert sorted((l["step"], l["rank"]) for l in lines) == \
        [(s, r) for s in range(steps) for r in range(RANKS)]
    assert not any(l["local"] for l in lines)
    assert "reports delivered: True" in result.stdout

    def calls(method):
        import urllib.request
        text = urllib.request.urlopen(planner.metrics_url, timeout=10).read().decode()
        series = f'sparsebalance_rpcs_total{{code="OK",method="{method}"}} '
        return sum(float(line[len(series):]) for line in text.splitlines()
                   if line.startswith(series))

    assert calls("GetRankPlan") == 0 and calls("GetRankPlans") == steps
    assert calls("ReportStep") == 0 and 1 <= calls("ReportStepBatch") <= steps


def test_an_unreachable_planner_stops_the_run_unless_offline(tmp_path):
    result, _ = run_example(tmp_path, "--planner=127.0.0.1:1", "--steps=2", check=False)
    assert result.returncode != 0
    assert "127.0.0.1:1" in result.stderr and "UNAVAILABLE" in result.stderr
    steps = 3
    result, lines = run_example(tmp_path, "--planner=127.0.0.1:1", "--offline",
                                f"--steps={steps}")
    assert sorted((l["step"], l["rank"]) for l in lines) == \
        [(s, r) for s in range(steps) for r in range(RANKS)]
    assert all(l["local"] for l in lines)
    assert f"{steps} steps on local plans" in result.stdout
    # Every rank ran its part of one local plan: the documents add up, none twice.
    for s in range(steps):
        assert sum(l["docs"] for l in lines if l["step"] == s) > 0


def test_the_example_has_ten_sparsebalance_lines():
    # README counts the lines marked "# SB"; every line that touches SparseBalance is marked.
    code = EXAMPLE.read_text().split('"""', 2)[2]  # after the module docstring
    marked = [line for line in code.splitlines() if line.rstrip().endswith("# SB") or
              "# SB (" in line]
    # Options a trainer may leave out (--by_node's) are marked "# SB (optional)".
    assert len([line for line in marked if "# SB (optional)" not in line]) <= 10, marked
    touches = re.compile(r"sparsebalance|\bsbt\.|balancer|mb\.attention|loss_weight|"
                         r"document_weight")
    unmarked = [line for line in code.splitlines()
                if touches.search(line) and line not in marked]
    assert not unmarked, unmarked
