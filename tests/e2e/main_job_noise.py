#!/usr/bin/env python3
"""Runs sb-run (the main job) N times and prints the distribution of what the workers measured
and what the planner predicted, per policy: the noise that tests/e2e's main-job test and the
README's figures must allow for. Not a test: it measures.

  python3 tests/e2e/main_job_noise.py --sb-run build/worker/sb-run --runs 10 -- --steps=6

Arguments after -- go to sb-run (each run gets its own --out, --state_dir and a free port)."""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile


def predicted_imbalance(path, ranks):
    """Mean over complete steps of max/mean of the plans' predicted rank times."""
    by_step = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                s = json.loads(line)
                by_step.setdefault(s["step"], {})[s["rank"]] = s["predicted_seconds"]
    ratios = []
    for ranks_seen in by_step.values():
        if len(ranks_seen) == ranks:
            t = list(ranks_seen.values())
            ratios.append(max(t) / (sum(t) / len(t)))
    return sum(ratios) / len(ratios)


def describe(values):
    values = sorted(values)
    return (f"min {values[0]:.3f}  median {statistics.median(values):.3f}  "
            f"max {values[-1]:.3f}  sd {statistics.pstdev(values):.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sb-run", default="build/worker/sb-run")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--json", help="append one JSON line per run here")
    parser.add_argument("--keep", help="copy each run's step lines and summary under KEEP/run-N")
    parser.add_argument("sb_run_args", nargs="*")
    args = parser.parse_args()
    rows = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="sb-noise-") as tmp:
            out = os.path.join(tmp, "out")
            cmd = [args.sb_run, "--planner_listen=127.0.0.1:0", f"--state_dir={tmp}/state",
                   f"--out={out}", f"--workers={args.workers}", *args.sb_run_args]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                logs = "".join(open(os.path.join(out, n)).read()[-1500:]
                               for n in sorted(os.listdir(out)) if n.endswith(".log"))
                sys.exit(f"run {i}: sb-run failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}\n"
                         f"{logs}")
            with open(os.path.join(out, "summary.json")) as f:
                summary = {r["policy"]: r for r in json.load(f)["runs"]}
            for policy, r in summary.items():
                r["predicted_imbalance"] = predicted_imbalance(
                    os.path.join(out, f"{policy}.steps.jsonl"), args.workers)
            if args.keep:
                shutil.copytree(out, os.path.join(args.keep, f"run-{i}"),
                                ignore=shutil.ignore_patterns("*.token", "*.svg"))
            seq, sb = summary["sequential"], summary["sparsebalance"]
            row = {"run": i, "speedup": seq["mean_step_seconds"] / sb["mean_step_seconds"],
                   "policies": summary}
            rows.append(row)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
            print(f"run {i}: imbalance seq {seq['imbalance']:.3f} sb {sb['imbalance']:.3f} "
                  f"(predicted {seq['predicted_imbalance']:.3f} / "
                  f"{sb['predicted_imbalance']:.3f}), recall {seq['mean_recall']:.3f} / "
                  f"{sb['mean_recall']:.3f}, error {seq['prediction_error']:.1%} / "
                  f"{sb['prediction_error']:.1%}, speed-up {row['speedup']:.2f}x", flush=True)
    print(f"\n{len(rows)} runs of: sb-run {' '.join(args.sb_run_args)}")
    for key in ["imbalance", "bubble_ratio", "predicted_imbalance", "mean_recall", "mean_density",
                "prediction_error", "mean_step_seconds"]:
        for policy in ["sequential", "sparsebalance"]:
            print(f"{key:20s} {policy:14s} {describe([r['policies'][policy][key] for r in rows])}")
    print(f"{'speed-up':35s} {describe([r['speedup'] for r in rows])}")
    margin = [r["policies"]["sequential"]["imbalance"] - r["policies"]["sparsebalance"]["imbalance"]
              for r in rows]
    print(f"{'imbalance seq - sb (measured)':35s} {describe(margin)}")
    margin = [r["policies"]["sequential"]["predicted_imbalance"] -
              r["policies"]["sparsebalance"]["predicted_imbalance"] for r in rows]
    print(f"{'imbalance seq - sb (predicted)':35s} {describe(margin)}")
    margin = [r["policies"]["sparsebalance"]["mean_recall"] -
              r["policies"]["sequential"]["mean_recall"] for r in rows]
    print(f"{'recall sb - seq':35s} {describe(margin)}")


if __name__ == "__main__":
    main()
