"""Live check of deploy/: a real sb-planner with traffic, a real Prometheus scraping it every
second with deploy/prometheus/prometheus.yml (target and intervals substituted) and rules.yml,
then every query of the Grafana dashboard and every alert expression through Prometheus' HTTP
API. A panel query must return data (a number, not only NaN); an alert expression must evaluate
without error and its rule must be loaded and healthy. Also runs the image's health check
script against the planner. Everything started is stopped at the end.

    live_check.py --sb-planner BIN --sb-load BIN [--deploy DIR]
"""
import argparse
import json
import math
import os
import re
import subprocess
import tempfile
import time
import urllib.parse

import sbdeploy

RATE_INTERVAL = "10s"  # $__rate_interval at a 1 s scrape (Grafana's own would be 4 s)
SUBSTITUTIONS = {  # Grafana's built-in variables, as concrete values for this check
    "__rate_interval": RATE_INTERVAL,
    "__interval": "2s",
    "__interval_ms": "2000",
    "__range": "60s",
    "__range_s": "60",
    "__range_ms": "60000",
}


def substitute(expr, variables):
    def value(match):
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise KeyError(name)
        return variables[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", value, expr)


class Prometheus:
    def __init__(self, address):
        self.base = f"http://{address}"

    def api(self, path, **params):
        url = f"{self.base}/api/v1/{path}?" + urllib.parse.urlencode(params, doseq=True)
        try:
            reply = json.loads(sbdeploy.http_get(url))
        except Exception as error:  # HTTP 400/422 carry the PromQL error in the body
            body = getattr(error, "read", lambda: b"")().decode(errors="replace")
            return {"status": "error", "error": f"{error} {body}"}
        return reply

    def query(self, expr):
        return self.api("query", query=expr)

    def scalar(self, expr):
        reply = self.query(expr)
        if reply.get("status") != "success" or not reply["data"]["result"]:
            return None
        return float(reply["data"]["result"][0]["value"][1])


def panels_of(dashboard):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # panels of collapsed rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sb-planner", required=True)
    parser.add_argument("--sb-load", required=True)
    parser.add_argument("--sb-run", help="traffic from a short sb-worker run instead of sb-load")
    parser.add_argument("--deploy", default=os.path.join(sbdeploy.repo_root(), "deploy"))
    args = parser.parse_args()
    prometheus_bin = sbdeploy.find_tool("prometheus", "Debian package prometheus")
    deadline = sbdeploy.Deadline(90)
    with open(f"{args.deploy}/grafana/dashboards/sparsebalance.json") as f:
        dashboard = json.load(f)
    with open(f"{args.deploy}/prometheus/prometheus.yml") as f:
        config = f.read()

    with tempfile.TemporaryDirectory() as tmp, sbdeploy.Processes() as procs:
        planner = sbdeploy.start_planner(procs, sbdeploy.planner_args(args.sb_planner,
                                                                      f"{tmp}/state"))
        print(f"sb-planner: gRPC {planner.grpc}, metrics {planner.metrics}")

        # The image's health check against a live planner.
        health = subprocess.run(
            ["bash", f"{args.deploy}/docker/healthcheck.sh"], capture_output=True, text=True,
            timeout=10, env=dict(os.environ, SB_LISTEN=planner.grpc,
                                 SB_METRICS_LISTEN=planner.metrics,
                                 # sb-health is built next to sb-planner
                                 SB_HEALTH_BIN=os.path.join(os.path.dirname(args.sb_planner),
                                                            "sb-health")))
        if health.returncode != 0:
            sbdeploy.fail(f"deploy/docker/healthcheck.sh says unhealthy: {health.stdout}"
                          f"{health.stderr}")

        # Steps keep coming for longer than this check runs (it stops them at the end), so that
        # rates and histogram quantiles over the last seconds have data.
        traffic = sbdeploy.generate_traffic(procs, args.sb_load, planner.grpc,
                                            steps=2000 if args.sb_run else 20000,
                                            sb_run=args.sb_run, out_dir=f"{tmp}/run")

        # deploy/prometheus/prometheus.yml with this planner as the target and 1 s intervals.
        for old, new in [("planner:9151", planner.metrics), ("scrape_interval: 15s",
                                                             "scrape_interval: 1s"),
                         ("evaluation_interval: 15s", "evaluation_interval: 1s")]:
            if old not in config:
                sbdeploy.fail(f"deploy/prometheus/prometheus.yml no longer contains {old!r}")
            config = config.replace(old, new)
        with open(f"{tmp}/prometheus.yml", "w") as f:
            f.write(config)
        with open(f"{args.deploy}/prometheus/rules.yml") as src, open(f"{tmp}/rules.yml",
                                                                      "w") as dst:
            dst.write(src.read())
        address = f"127.0.0.1:{sbdeploy.free_port()}"
        with open(f"{tmp}/prometheus.log", "w") as log:
            procs.start([prometheus_bin, f"--config.file={tmp}/prometheus.yml",
                         f"--storage.tsdb.path={tmp}/tsdb", f"--web.listen-address={address}",
                         "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=log)
        prom = Prometheus(address)

        # Wait until the job's series have been scraped often enough for RATE_INTERVAL windows.
        while True:
            if deadline.left() <= 0:
                with open(f"{tmp}/prometheus.log") as log:
                    sbdeploy.fail("Prometheus did not scrape the planner's job series in time; "
                                  f"its log ends: {log.read()[-2000:]}")
            if traffic.poll() is not None:
                sbdeploy.fail(f"the traffic stopped early: {traffic.stderr.read()}")
            scrapes = prom.scalar("min(count_over_time("
                                  f"sparsebalance_planned_steps_total[{RATE_INTERVAL}]))")
            if scrapes is not None and scrapes >= 6:
                break
            time.sleep(0.5)
        if prom.scalar('up{job="sb-planner"}') != 1:
            sbdeploy.fail('up{job="sb-planner"} is not 1')

        # The dashboard's variables: the job variable's query must list the running job.
        variables = dict(SUBSTITUTIONS, datasource="prometheus")
        for var in dashboard["templating"]["list"]:
            if var["type"] != "query":
                continue
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
            if not found:
                sbdeploy.fail(f"variable {var['name']}: cannot evaluate {query!r}")
            values = prom.api(f"label/{found.group(2)}/values", **{"match[]": found.group(1)})
            if values.get("status") != "success" or not values["data"]:
                sbdeploy.fail(f"variable {var['name']}: {query} lists nothing: {values}")
            variables[var["name"]] = "|".join(values["data"])
            print(f"variable {var['name']} = {variables[var['name']]}")

        # Every panel query returns data.
        failures = []
        checked = 0
        for panel in panels_of(dashboard):
            for target in panel.get("targets", []):
                title = f"panel {panel['title']!r} query {target.get('refId')}"
                try:
                    expr = substitute(target["expr"], variables)
                except KeyError as unknown:
                    failures.append(f"{title}: unknown variable ${unknown.args[0]}")
                    continue
                reply = prom.query(expr)
                checked += 1
                if reply.get("status") != "success":
                    failures.append(f"{title}: {reply.get('error')} ({expr})")
                    continue
                result = reply["data"]["result"]
                numbers = [float(r["value"][1]) for r in result]
                if not any(math.isfinite(v) for v in numbers):
                    failures.append(f"{title}: no data ({len(result)} series, "
                                    f"values {numbers[:4]}) for {expr}")

        # Every alert expression evaluates, and Prometheus runs every rule without error.
        while True:
            deadline.check("waiting for every rule's first evaluation")
            groups = prom.api("rules").get("data", {}).get("groups", [])
            rules = [rule for group in groups for rule in group["rules"]]
            if rules and all(rule.get("health") != "unknown" for rule in rules):
                break
            time.sleep(0.5)
        for rule in rules:
            reply = prom.query(rule["query"])
            checked += 1
            if reply.get("status") != "success":
                failures.append(f"alert {rule['name']}: {reply.get('error')}")
            if rule.get("health") != "ok":
                failures.append(f"alert {rule['name']}: health {rule.get('health')}: "
                                f"{rule.get('lastError')}")
        loaded = {r["name"] for r in rules}
        with open(f"{args.deploy}/prometheus/rules.yml") as f:
            defined = set(re.findall(r"^\s+- alert: (\w+)", f.read(), re.M))
        if loaded != defined:
            failures.append(f"rules loaded {sorted(loaded)} != rules.yml's {sorted(defined)}")
        if traffic.poll() is not None:
            failures.append("the traffic ended before the queries did (its rates may be stale)")

    sbdeploy.finish(failures, f"live check: {checked} queries ({len(defined)} alerts) returned "
                              f"data or evaluated; {90 - deadline.left():.1f} s")


if __name__ == "__main__":
    main()
