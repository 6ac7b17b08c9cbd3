"""examples/pytorch/train.py end to end: four gloo ranks train with a real sb-planner and the
loss goes down; with the planner stopped they keep training on local plans, all agreeing."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

import sparsebalance as sb  # noqa: E402
from conftest import REPO  # noqa: E402

EXAMPLE = REPO / "examples" / "pytorch" / "train.py"
RANKS = 4


def run_example(tmp_path, *flags, timeout=240):
    out = tmp_path / "steps.jsonl"
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), f"--ranks={RANKS}", "--eval_docs=0", "--quiet_ranks",
         f"--out={out}", *flags],
        capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return result, lines


def test_trains_with_a_real_planner(planner, tmp_path):
    steps = 8
    result, lines = run_example(tmp_path, f"--planner={planner.address}", f"--steps={steps}")
    assert f"created job" in result.stdout
    assert sorted((l["step"], l["rank"]) for l in lines) == \
        [(s, r) for s in range(steps) for r in range(RANKS)]
    assert not any(l["local_fallback"] for l in lines)
    assert all(l["reported"] for l in lines)  # every report reached the planner
    for l in lines:
        if l["docs"]:
            assert l["compute_seconds"] > 0 and 0 < l["density"] <= 1 and 0 < l["recall"] <= 1
        assert l["wait_seconds"] >= 0
    loss = [next(l["loss"] for l in lines if l["step"] == s and l["rank"] == 0)
            for s in range(steps)]
    # All ranks agree on the global loss of a step (it is all-reduced).
    assert all(abs(l["loss"] - loss[l["step"]]) < 1e-6 for l in lines)
    # From ln(64) ~ 4.16 at the start, well down within a few steps.
    assert sum(loss[-3:]) / 3 < sum(loss[:2]) / 2 - 0.3, loss


def test_keeps_training_when_the_planner_is_stopped(planner, tmp_path):
    # The job exists (as in a cluster), then the planner goes away before training starts.
    config = sb.PlannerConfig(ranks=RANKS, micro_batches=2, micro_batch_capacity=2048,
                              density_default=0.3, density_min=0.1,
                              shape=sb.ModelShape(layers=2, heads=2, head_dim=64))
    client = sb.connect(planner.address)
    job = client.create_job("stopped-planner", config)
    token_file = tmp_path / "token"
    token_file.write_text(job.token)
    planner.stop()
    steps = 3
    result, lines = run_example(tmp_path, f"--planner={planner.address}", f"--job={job.job_id}",
                                f"--token_file={token_file}", f"--steps={steps}")
    assert "planner unreachable" in result.stdout
    assert sorted((l["step"], l["rank"]) for l in lines) == \
        [(s, r) for s in range(steps) for r in range(RANKS)]
    assert all(l["local_fallback"] and not l["reported"] for l in lines)
    # Every rank ran its part of one local plan: the documents add up to the global batch.
    for s in range(steps):
        docs = [l["docs"] for l in lines if l["step"] == s]
        assert sum(docs) > 0
