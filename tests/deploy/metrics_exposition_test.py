"""sb-planner's /metrics, after real traffic, passes `promtool check metrics` and exposes every
series family that README.md's metrics table lists.

    metrics_exposition_test.py --sb-planner BIN --sb-load BIN
"""
import argparse
import re
import subprocess
import tempfile

import sbdeploy


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sb-planner", required=True)
    parser.add_argument("--sb-load", required=True)
    args = parser.parse_args()
    promtool = sbdeploy.find_tool("promtool", "Debian package prometheus")

    with tempfile.TemporaryDirectory() as tmp, sbdeploy.Processes() as procs:
        planner = sbdeploy.start_planner(procs, sbdeploy.planner_args(args.sb_planner,
                                                                      f"{tmp}/state"))
        traffic = sbdeploy.generate_traffic(procs, args.sb_load, planner.grpc, steps=20)
        try:
            _, errors = traffic.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            sbdeploy.fail("the traffic did not finish 20 steps within 60 s")
        if traffic.returncode != 0:
            sbdeploy.fail(f"the traffic failed: {errors}")
        exposition = sbdeploy.http_get(f"http://{planner.metrics}/metrics")

    check = subprocess.run([promtool, "check", "metrics"], input=exposition, text=True,
                           capture_output=True, timeout=30)
    if check.returncode != 0:
        sbdeploy.fail(f"promtool check metrics:\n{check.stdout}{check.stderr}")
    print(f"promtool check metrics: clean ({len(exposition.splitlines())} lines)")

    exposed = set(re.findall(r"^# TYPE (\S+) ", exposition, re.M))
    with open(f"{sbdeploy.repo_root()}/README.md") as readme:
        documented = set(re.findall(r"^\| `(sparsebalance_[a-z_]+)` \|", readme.read(), re.M))
    missing = sorted(documented - exposed)
    if missing:
        sbdeploy.fail(f"README.md's metrics table lists families /metrics lacks: {missing}")
    undocumented = sorted(n for n in exposed - documented if n.startswith("sparsebalance_"))
    if undocumented:
        sbdeploy.fail(f"/metrics has families README.md's metrics table lacks: {undocumented}")
    print(f"all {len(documented)} families of README.md's metrics table are exposed")


if __name__ == "__main__":
    main()
