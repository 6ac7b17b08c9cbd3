"""deploy/'s manifests agree with the code and with each other: every file parses; every
sb-planner flag they set (directly or as an SB_* variable through the image's entrypoint) is in
`sb-planner --helpfull`, and every sb-load flag in `sb-load --helpfull`; ports match across the
ConfigMap, containers, probes, Service, ServiceMonitor, Dockerfile, compose and prometheus.yml;
the readiness probe names server/main.cc's kServiceName and liveness asks "" on the health-only
listener; base images are pinned by digest (the planner's own image by tag, pinned after a push
by scripts/pin-images.sh); no Secret is in the kustomization (the admin token is created once
by hand, as deploy/README.md shows); the PodDisruptionBudget, NetworkPolicy and ServiceAccount
select the planner's pods and ports; referenced paths exist;
the drain fits in the grace period; the PrometheusRule equals rules.yml; the dashboard and the
rules use only metrics server/planner_metrics.cc defines; the runtime image installs the
packages of the libraries the binaries link. Finally the entrypoint starts the real planner with
the ConfigMap's settings, the health check script (sb-health) passes against it, and fails once
it has stopped.

    manifests_test.py --sb-planner BIN [--sb-health BIN] [--sb-load BIN]
    manifests_test.py --write-prometheusrule   # regenerate deploy/k8s/prometheusrule.yaml
"""
import argparse
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile

import sbdeploy

try:
    import yaml
except ImportError:
    sbdeploy.skip("python3 lacks yaml (Debian package python3-yaml; scripts/install-deps.sh)")

ROOT = sbdeploy.repo_root()
DEPLOY = os.path.join(ROOT, "deploy")
PROMETHEUSRULE_HEADER = (
    "# deploy/prometheus/rules.yml for the Prometheus Operator. Generated, do not edit: change\n"
    "# rules.yml and run `python3 tests/deploy/manifests_test.py --write-prometheusrule`\n"
    "# (the test fails while the two differ).\n")

failures = []


def check(condition, message):
    if not condition:
        failures.append(message)
    return condition


def load_yaml(path):
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def port_of(address):
    return int(address.rsplit(":", 1)[1])


# IMAGE:TAG@sha256:DIGEST (the tag says which release, the digest is what is pulled).
PINNED_IMAGE = re.compile(r"^[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}$")


def help_flags(binary):
    out = subprocess.run([binary, "--helpfull"], capture_output=True, text=True, timeout=30)
    return set(re.findall(r"^\s+--(\w+) \(", out.stdout + out.stderr, re.M))


def flags_in(words):
    """Flag names in a list of command-line words (--name=value, --name, --noname)."""
    return [re.match(r"--(\w+)", w).group(1) for w in words if re.match(r"--\w", w)]


def write_prometheusrule():
    rules = load_yaml(f"{DEPLOY}/prometheus/rules.yml")[0]
    doc = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
           "metadata": {"name": "sb-planner",
                        "labels": {"app.kubernetes.io/name": "sb-planner",
                                   "app.kubernetes.io/part-of": "sparsebalance"}},
           "spec": {"groups": rules["groups"]}}
    with open(f"{DEPLOY}/k8s/prometheusrule.yaml", "w") as f:
        f.write(PROMETHEUSRULE_HEADER + yaml.safe_dump(doc, sort_keys=False, width=100))


def dockerfile_instructions(path):
    """(instruction, arguments) pairs, continuation lines joined, comments dropped."""
    with open(path) as f:
        text = re.sub(r"^\s*#.*\n", "", f.read(), flags=re.M)
    text = re.sub(r"\\\n", " ", text)
    return [(m.group(1).upper(), m.group(2).strip())
            for m in re.finditer(r"^(\w+)\s+(.*)$", text, re.M)]


def apt_packages(run):
    """The packages a Dockerfile RUN line installs (apt-get install --no-install-recommends)."""
    words = run.split("--no-install-recommends", 1)[1].split("&&")[0]
    return set(re.findall(r"(?<=\s)([a-z0-9][a-z0-9.+-]+)(?=\s)", words + " "))


def installed_closure(packages):
    """The packages and everything they depend on, as installed on this machine (dpkg)."""
    out = subprocess.run(["dpkg-query", "-W", "-f=${Package}\t${Depends},${Pre-Depends}\n"],
                         capture_output=True, text=True).stdout
    depends = {}
    for line in out.splitlines():
        name, _, deps = line.partition("\t")
        depends[name] = [d.strip().split(" ")[0].split(":")[0] for d in re.split(r"[,|]", deps)]
    seen, todo = set(), list(packages)
    while todo:
        p = todo.pop()
        if p and p not in seen:
            seen.add(p)
            todo.extend(depends.get(p, []))
    return seen


def owners(paths):
    """Debian package of each file (dpkg -S), by path; merged-/usr paths tried both ways."""
    found = {}
    for line in subprocess.run(["dpkg", "-S"] + paths, capture_output=True,
                               text=True).stdout.splitlines():
        package, _, path = line.partition(": ")
        found[path] = package.split(":")[0]
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sb-planner")
    parser.add_argument("--sb-load")
    parser.add_argument("--sb-health")
    parser.add_argument("--write-prometheusrule", action="store_true")
    args = parser.parse_args()
    if args.write_prometheusrule:
        write_prometheusrule()
        print("wrote deploy/k8s/prometheusrule.yaml")
        return
    if not args.sb_planner:
        parser.error("--sb-planner is needed")

    planner_flags = help_flags(args.sb_planner)
    check({"listen", "metrics_listen", "state_dir"} <= planner_flags,
          f"cannot read sb-planner's flags from --helpfull: {sorted(planner_flags)}")
    load_flags = help_flags(args.sb_load) if args.sb_load else None
    with open(f"{ROOT}/server/main.cc") as f:
        service_name = re.search(r'kServiceName\[\] = "([^"]+)"', f.read()).group(1)

    # --- the image: Dockerfile, entrypoint, health check --------------------------------------
    docker = dockerfile_instructions(f"{DEPLOY}/docker/Dockerfile")
    with open(f"{DEPLOY}/docker/entrypoint.sh") as f:
        env_flags = dict(re.findall(r"^flag (SB_\w+) (\w+)$", f.read(), re.M))
    for var, flag in env_flags.items():
        check(flag in planner_flags,
              f"entrypoint.sh maps {var} to --{flag}, which sb-planner lacks")
    sb_flags_help = subprocess.run([args.sb_planner, "--help"], capture_output=True, text=True)
    listed = set(re.findall(r"^\s+--(\w+) \(", sb_flags_help.stdout + sb_flags_help.stderr, re.M))
    check(not (listed - set(env_flags.values())),
          f"sb-planner flags without an SB_* variable in entrypoint.sh: "
          f"{sorted(listed - set(env_flags.values()))}")

    env = {}
    copies = []
    for instruction, rest in docker:
        if instruction == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", rest)))
        if instruction == "COPY" and "--from=" not in rest:
            words = shlex.split(rest)
            copies.append((words[:-1], words[-1]))
    for sources, _ in copies:
        for source in sources:
            check(glob.glob(os.path.join(ROOT, source)),
                  f"Dockerfile COPYs {source}, which does not exist in the repository")
    destinations = {dest for _, dest in copies} | {
        f"/usr/local/bin/{os.path.basename(s)}" for instr, rest in docker if instr == "COPY"
        and "--from=" in rest for s in shlex.split(rest)[1:-1]}
    for instruction, rest in docker:
        if instruction in ("ENTRYPOINT", "HEALTHCHECK"):
            for program in re.findall(r'"(/[^"]+)"', rest):
                check(program in destinations, f"Dockerfile {instruction} runs {program}, "
                      "which no COPY puts there")
    for var in env:
        if var.startswith("SB_"):
            check(var in env_flags, f"Dockerfile sets {var}, which entrypoint.sh ignores")
    exposed = {int(p) for instr, rest in docker if instr == "EXPOSE" for p in rest.split()}
    grpc_port, metrics_port = port_of(env["SB_LISTEN"]), port_of(env["SB_METRICS_LISTEN"])
    health_port = port_of(env.get("SB_HEALTH_LISTEN", ":0"))
    check(health_port > 0, "the image sets no SB_HEALTH_LISTEN: its HEALTHCHECK (liveness) needs "
          "the health-only listener, which stays open for the whole drain")
    check(exposed == {grpc_port, metrics_port, health_port},
          f"Dockerfile EXPOSE {sorted(exposed)} != SB_LISTEN/SB_METRICS_LISTEN/SB_HEALTH_LISTEN ports")
    healthchecks = [rest for instr, rest in docker if instr == "HEALTHCHECK"]
    check(len(healthchecks) == 1 and "/usr/local/bin/sb-planner-healthcheck" in healthchecks[0],
          f"Dockerfile HEALTHCHECK {healthchecks} does not run healthcheck.sh")
    with open(f"{DEPLOY}/docker/healthcheck.sh") as f:
        healthcheck = f.read()
    check(re.search(r"^exec .*--service=(\s|$)", healthcheck, re.M) and
          "/usr/local/bin/sb-health" in healthcheck and "SB_HEALTH_LISTEN" in healthcheck,
          "healthcheck.sh must ask sb-health for service \"\" (liveness) on SB_HEALTH_LISTEN")
    check("/build/server/sb-health" in " ".join(rest for instr, rest in docker if instr == "COPY"),
          "the image does not install sb-health, which healthcheck.sh runs")
    volumes = [v for instr, rest in docker if instr == "VOLUME" for v in json.loads(rest)]
    check(any(env["SB_STATE_DIR"].startswith(v + "/") for v in volumes),
          f"SB_STATE_DIR={env['SB_STATE_DIR']} is not on a VOLUME {volumes}")
    for image in [rest.split()[0] for instr, rest in docker if instr == "FROM"]:
        check(PINNED_IMAGE.match(image) and ":latest@" not in image,
              f"Dockerfile FROM {image}: pin it by digest, IMAGE:TAG@sha256:... (scripts/pin-images.sh)")
    with open(f"{ROOT}/scripts/install-deps.sh") as f:
        deps = set(re.search(r"packages=\((.*?)\)", f.read(), re.S).group(1).split())
    stages = [rest for instr, rest in docker if instr == "RUN" and "apt-get install" in rest]
    build_packages, runtime_packages = [apt_packages(stage) for stage in stages]
    check(build_packages <= deps, f"the build stage installs packages scripts/install-deps.sh "
          f"lacks: {sorted(build_packages - deps)}")
    if shutil.which("dpkg-query") and shutil.which("ldd"):
        closure = installed_closure(runtime_packages)
        binaries = [args.sb_planner] + [b for b in (args.sb_load, args.sb_health) if b]
        libs = re.findall(r"=> (\S+) \(", subprocess.run(["ldd"] + binaries, capture_output=True,
                                                      text=True).stdout)
        libs = sorted(set(libs))
        candidates = libs + [os.path.realpath(lib) for lib in libs]
        candidates += [p.replace("/lib/", "/usr/lib/",
                                 1) for p in candidates if p.startswith("/lib/")]
        package_of = owners(candidates)
        for lib in libs:
            real = os.path.realpath(lib)
            package = next((package_of[p] for p in (lib, real, lib.replace("/lib/", "/usr/lib/", 1),
                                                     real.replace("/lib/", "/usr/lib/", 1))
                            if p in package_of), None)
            check(package in closure,
                  f"{lib} (package {package or '?'}) is not installed by the runtime stage")

    # --- compose ------------------------------------------------------------------------------
    compose = load_yaml(f"{DEPLOY}/compose.yaml")[0]
    services = compose["services"]
    planner = services["planner"]
    build = planner["build"]
    check(os.path.exists(os.path.join(DEPLOY, build["context"], build["dockerfile"])),
          f"compose builds {build['dockerfile']}, which does not exist")
    for name, service in services.items():
        image = service.get("image", "")
        if "build" in service:  # built here from the pinned Dockerfile: a tag is all there is
            check(re.search(r":[\w.-]+$", image) and not image.endswith(":latest"),
                  f"compose service {name}: image {image!r} has no pinned tag")
        else:
            check(PINNED_IMAGE.match(image) and ":latest@" not in image,
                  f"compose service {name}: image {image!r} is not pinned by digest "
                  "(IMAGE:TAG@sha256:..., scripts/pin-images.sh)")
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                check(os.path.exists(os.path.join(DEPLOY, source)),
                      f"compose service {name} mounts {source}, which does not exist")
        for key in ("entrypoint", "command"):
            words = service.get(key) or []
            text = " ".join(words) if isinstance(words, list) else words
            for call in re.findall(r"\bsb-load ((?:--\S+\s*)+)", text):
                if load_flags is not None:
                    for flag in flags_in(call.split()):
                        check(flag in load_flags, f"compose {name} passes sb-load --{flag}, "
                              "which sb-load lacks")
            if name == "planner" and words:
                for flag in flags_in(words if isinstance(words, list) else shlex.split(words)):
                    check(flag in planner_flags, f"compose planner passes --{flag}")
    penv = planner["environment"]
    for var in penv:
        check(var in env_flags, f"compose planner sets {var}, which entrypoint.sh ignores")
    c_grpc, c_metrics = port_of(penv["SB_LISTEN"]), port_of(penv["SB_METRICS_LISTEN"])
    published = {int(p.rsplit(":", 1)[1]) for p in planner["ports"]}
    check(published == {c_grpc, c_metrics}, f"compose planner publishes {sorted(published)}, "
          f"listens on {c_grpc} and {c_metrics}")
    check(c_grpc == grpc_port and c_metrics == metrics_port,
          "compose planner ports differ from the image's defaults")
    drain = float(penv.get("SB_DRAIN_SECONDS", env.get("SB_DRAIN_SECONDS", 10)))
    grace = float(planner["stop_grace_period"].rstrip("s"))
    check(grace > drain, f"compose stop_grace_period {grace} s is not above the drain {drain} s")
    demo = " ".join(services["demo-load"]["entrypoint"])
    check(f"--planner=planner:{c_grpc}" in demo,
          "compose demo-load does not dial planner's gRPC port")
    check(penv["SB_ADMIN_TOKEN_FILE"] in demo, "compose demo-load reads another admin token file")

    # --- Prometheus and Grafana (compose side) --------------------------------------------------
    prom_config = load_yaml(f"{DEPLOY}/prometheus/prometheus.yml")[0]
    scrape = prom_config["scrape_configs"][0]
    check(scrape["static_configs"][0]["targets"] == [f"planner:{c_metrics}"],
          f"prometheus.yml scrapes {scrape['static_configs'][0]['targets']}, "
          f"not planner:{c_metrics}")
    scrape_job = scrape["job_name"]
    for rule_file in prom_config["rule_files"]:
        check(os.path.exists(f"{DEPLOY}/prometheus/{rule_file}"),
              f"prometheus.yml loads {rule_file}")
        mounted = [v.split(":")[1] for v in services["prometheus"]["volumes"]]
        check(f"/etc/prometheus/{rule_file}" in mounted, f"compose does not mount {rule_file}")
    datasource = load_yaml(f"{DEPLOY}/grafana/provisioning/datasources/prometheus.yaml")[0]
    check(datasource["datasources"][0]["url"] == "http://prometheus:9090" and
          "127.0.0.1:9090:9090" in services["prometheus"]["ports"],
          "the Grafana datasource does not point at compose's Prometheus")
    provider = load_yaml(f"{DEPLOY}/grafana/provisioning/dashboards/sparsebalance.yaml")[0]
    dash_path = provider["providers"][0]["options"]["path"]
    mounts = dict(reversed(v.split(":")[:2]) for v in services["grafana"]["volumes"])
    check(dash_path in mounts,
          f"the dashboard provider reads {dash_path}, which compose does not mount")
    check(mounts.get(dash_path) and glob.glob(os.path.join(DEPLOY, mounts[dash_path], "*.json")),
          f"no dashboards in {mounts.get(dash_path)}")
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    check(os.path.dirname(home) == dash_path and
          os.path.exists(os.path.join(DEPLOY, mounts.get(dash_path, "?"), os.path.basename(home))),
          f"Grafana's home dashboard {home} is not a provisioned file")

    # --- Kubernetes -----------------------------------------------------------------------------
    kustomization = load_yaml(f"{DEPLOY}/k8s/kustomization.yaml")[0]
    objects = {}
    for resource in kustomization["resources"]:
        path = f"{DEPLOY}/k8s/{resource}"
        if check(os.path.exists(path), f"kustomization lists {resource}, which does not exist"):
            for doc in load_yaml(path):
                objects[(doc["kind"], doc["metadata"]["name"])] = doc
    listed_files = set(kustomization["resources"]) | {"kustomization.yaml"}
    for path in glob.glob(f"{DEPLOY}/k8s/*.yaml"):
        check(os.path.basename(path) in listed_files, f"kustomization does not list {path}")
    with open(f"{DEPLOY}/k8s/kustomization.yaml") as f:
        kustomization_text = f.read()
    for image in kustomization.get("images", []):
        # Pinned by digest, or (the planner's own image, whose digest exists only once the user
        # has pushed it) by tag with the documented way to pin it.
        by_digest = re.fullmatch(r"sha256:[0-9a-f]{64}", image.get("digest", ""))
        by_tag = (image["name"] == "sparsebalance/sb-planner" and
                  image.get("newTag") not in (None, "latest") and
                  "pin-images.sh --kustomize" in kustomization_text and
                  os.access(f"{ROOT}/scripts/pin-images.sh", os.X_OK))
        check(by_digest or by_tag, f"kustomization image {image['name']} is not pinned by digest")
    check(not any(kind == "Secret" for kind, _ in objects),
          "kustomization lists a Secret: every `kubectl apply -k` would reset it (create it "
          "once by hand, deploy/README.md)")
    for name in ("serviceaccount.yaml", "poddisruptionbudget.yaml", "networkpolicy.yaml"):
        check(name in kustomization["resources"], f"kustomization does not list {name}")
    deployment = objects[("Deployment", "sb-planner")]
    config = objects[("ConfigMap", "sb-planner-config")]["data"]
    for var in config:
        check(var in env_flags, f"ConfigMap sets {var}, which entrypoint.sh ignores")
    spec = deployment["spec"]
    check(spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate",
          "the Deployment must be 1 replica with strategy Recreate (one owner of the state)")
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    check(container["image"].split(":")[-1] not in ("latest", container["image"]),
          f"Deployment image {container['image']} has no pinned tag")
    for env_from in container.get("envFrom", []):
        ref = env_from.get("configMapRef", {}).get("name")
        check(("ConfigMap", ref) in objects,
              f"Deployment reads ConfigMap {ref}, which is not listed")
    for arg in container.get("args", []) + container.get("command", [])[1:]:
        for flag in flags_in([arg]):
            check(flag in planner_flags, f"Deployment passes --{flag}, which sb-planner lacks")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    k_grpc, k_metrics = port_of(config["SB_LISTEN"]), port_of(config["SB_METRICS_LISTEN"])
    check(ports == {"grpc": k_grpc, "metrics": k_metrics,
                    "health": port_of(config.get("SB_HEALTH_LISTEN", ":0"))},
          f"container ports {ports} != ConfigMap's listen ports")
    k_health = port_of(config.get("SB_HEALTH_LISTEN", ":0"))
    check(k_health > 0, "the ConfigMap sets no SB_HEALTH_LISTEN: the probes need the health-only "
          "listener (plaintext, open for the whole drain)")
    # Readiness asks the planner's service (NOT_SERVING while it drains or cannot write its
    # state); startup and liveness ask "" (SERVING until the process exits: a drain is not a
    # crash), all on the health-only listener.
    for probe, want in (("startupProbe", ""), ("readinessProbe", service_name),
                        ("livenessProbe", "")):
        grpc = container.get(probe, {}).get("grpc")
        if check(grpc is not None, f"{probe} is not a native gRPC probe"):
            check(grpc["port"] == k_health,
                  f"{probe} probes port {grpc['port']}, the health listener is on {k_health}")
            check(grpc.get("service", "") == want,
                  f"{probe} asks for service {grpc.get('service', '')!r}, want {want!r}")
    check(container["resources"].get("requests") and container["resources"].get("limits"),
          "the container needs resource requests and limits")
    k_drain = float(config.get("SB_DRAIN_SECONDS", env.get("SB_DRAIN_SECONDS", 10)))
    check(pod["terminationGracePeriodSeconds"] > k_drain,
          f"terminationGracePeriodSeconds {pod['terminationGracePeriodSeconds']} is not above the "
          f"drain {k_drain} s")
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for name, volume in volumes.items():
        check(name in mounts, f"volume {name} is not mounted")
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            check(("PersistentVolumeClaim", claim) in objects, f"PVC {claim} is not listed")
            check(config["SB_STATE_DIR"].startswith(mounts[name] + "/"),
                  f"SB_STATE_DIR {config['SB_STATE_DIR']} is not on the PVC mount {mounts[name]}")
    # Secrets are created by hand, once (not in the kustomization, which would reset them):
    # deploy/README.md must show how, with the key the planner reads.
    with open(f"{DEPLOY}/README.md") as f:
        readme = f.read()
    for name, volume in volumes.items():
        if "secret" in volume:
            secret = volume["secret"]["secretName"]
            check(f"create secret generic {secret}" in readme or
                  f"create secret tls {secret}" in readme,
                  f"deploy/README.md does not show how to create Secret {secret}")
    admin_dir, admin_key = os.path.split(config["SB_ADMIN_TOKEN_FILE"])
    admin_volume = [n for n, p in mounts.items() if p == admin_dir]
    if check(admin_volume, f"SB_ADMIN_TOKEN_FILE {config['SB_ADMIN_TOKEN_FILE']} is not on a "
             "mounted volume"):
        admin_secret = volumes[admin_volume[0]].get("secret", {})
        check(admin_secret.get("secretName") and not admin_secret.get("optional", False),
              "the admin token must come from a required Secret (the pod waits for it)")
        check(re.search(rf"create secret generic {admin_secret.get('secretName')}\b[^\n]*\n?"
                        rf"[^\n]*--from-literal={admin_key}=", readme),
              f"deploy/README.md does not create Secret {admin_secret.get('secretName')} with key "
              f"{admin_key} (SB_ADMIN_TOKEN_FILE)")
    service = objects[("Service", "sb-planner")]
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    check(set(service_ports) == {"grpc", "metrics"}, f"Service ports {sorted(service_ports)}")
    for name, p in service_ports.items():
        check(p["targetPort"] in (name, ports.get(name)),
              f"Service port {name} targets {p['targetPort']}")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    check(all(labels.get(k) == v for k, v in service["spec"]["selector"].items()),
          "the Service selector does not match the pod labels")

    def selects_pods(selector, what):
        match = selector.get("matchLabels", {})
        check(match and all(labels.get(k) == v for k, v in match.items()),
              f"{what} selector {match} does not match the pod labels {labels}")

    account = objects.get(("ServiceAccount", pod.get("serviceAccountName", "default")))
    if check(account is not None, "the Deployment's serviceAccountName is not a listed "
             "ServiceAccount"):
        check(account.get("automountServiceAccountToken") is False and
              pod.get("automountServiceAccountToken") is False,
              "the planner calls no Kubernetes API: automountServiceAccountToken must be false")
    pdb = next((o for (kind, _), o in objects.items() if kind == "PodDisruptionBudget"), None)
    if check(pdb is not None, "no PodDisruptionBudget"):
        check(pdb["apiVersion"] == "policy/v1", "PodDisruptionBudget apiVersion")
        selects_pods(pdb["spec"]["selector"], "the PodDisruptionBudget")
        check(pdb["spec"].get("minAvailable") == spec["replicas"] or
              pdb["spec"].get("maxUnavailable") in (0, 1),
              f"PodDisruptionBudget {pdb['spec']} does not fit {spec['replicas']} replica(s)")
    policy = next((o for (kind, _), o in objects.items() if kind == "NetworkPolicy"), None)
    if check(policy is not None, "no NetworkPolicy"):
        selects_pods(policy["spec"]["podSelector"], "the NetworkPolicy")
        check("Ingress" in policy["spec"].get("policyTypes", []),
              "the NetworkPolicy does not restrict ingress")
        allowed = {}
        for rule in policy["spec"].get("ingress", []):
            rule_ports = rule.get("ports")
            check(rule_ports, f"NetworkPolicy rule {rule} opens every port")
            for p in rule_ports or []:
                port = ports.get(p["port"], p["port"])  # a name refers to a container port
                allowed[port] = rule.get("from")
        check(set(allowed) == {k_grpc, k_metrics},
              f"the NetworkPolicy admits ports {sorted(allowed)}, want gRPC {k_grpc} and "
              f"metrics {k_metrics} only (probes come from the node, never blocked)")
        check(allowed.get(k_metrics), "the NetworkPolicy admits the metrics port from anywhere: "
              "restrict it to Prometheus (a from: selector)")
    monitor = objects[("ServiceMonitor", "sb-planner")]
    check(monitor["apiVersion"] == "monitoring.coreos.com/v1", "ServiceMonitor apiVersion")
    check(all(service["metadata"]["labels"].get(k) == v
              for k, v in monitor["spec"]["selector"]["matchLabels"].items()),
          "the ServiceMonitor selector does not match the Service")
    endpoint = monitor["spec"]["endpoints"][0]
    check(endpoint["port"] in service_ports and endpoint["port"] == "metrics",
          f"the ServiceMonitor scrapes port {endpoint['port']}")
    translated = [{{"sourceLabels": "source_labels", "targetLabel": "target_label"}.get(k, k): v
                   for k, v in r.items()} for r in endpoint.get("metricRelabelings", [])]
    check(translated == (scrape.get("metric_relabel_configs") or []),
          "ServiceMonitor metricRelabelings differ from prometheus.yml's metric_relabel_configs")
    # The ServiceMonitor's `job` label is the Service name; compose's is prometheus.yml's job_name.
    check(service["metadata"]["name"] == scrape_job,
          f"Service name {service['metadata']['name']} != prometheus.yml job_name {scrape_job}")

    # --- rules, PrometheusRule, dashboard -------------------------------------------------------
    rules = load_yaml(f"{DEPLOY}/prometheus/rules.yml")[0]
    rule = objects[("PrometheusRule", "sb-planner")]
    check(rule["spec"]["groups"] == rules["groups"],
          "deploy/k8s/prometheusrule.yaml differs from rules.yml: run "
          "`python3 tests/deploy/manifests_test.py --write-prometheusrule`")
    with open(f"{ROOT}/server/planner_metrics.cc") as f:
        defined = set(re.findall(r'"(sparsebalance_\w+)"', f.read()))
    with open(f"{DEPLOY}/grafana/dashboards/sparsebalance.json") as f:
        dashboard = json.load(f)
    exprs = [("rules.yml " + r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]
    panels = [p for top in dashboard["panels"] for p in [top] + top.get("panels", [])]
    exprs += [(f"panel {p['title']!r}", t["expr"]) for p in panels for t in p.get("targets", [])]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    exprs += [(f"variable {n}", v["query"]["query"]) for n,
              v in variables.items() if v["type"] == "query"]
    for where, expr in exprs:
        for metric in re.findall(r"\bsparsebalance_\w+", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", metric)
            check(metric in defined or base in defined,
                  f"{where} uses {metric}, which server/planner_metrics.cc does not define")
        for job in re.findall(r'\bjob="([^"]+)"', expr):
            check(job == scrape_job,
                  f"{where} selects job={job!r}, the scrape job is {scrape_job!r}")
    # Every alert links its runbook: a section of deploy/runbooks.md (GitHub's heading anchor).
    with open(f"{DEPLOY}/runbooks.md") as f:
        anchors = {h.strip().lower() for h in re.findall(r"^## (.+)$", f.read(), re.M)}
    for g in rules["groups"]:
        for r in g["rules"]:
            url = r.get("annotations", {}).get("runbook_url", "")
            check(re.match(r"https://\S+/deploy/runbooks\.md#\S+$", url) is not None,
                  f"rules.yml {r['alert']}: runbook_url {url!r} is not a link into "
                  "deploy/runbooks.md")
            check(url.rpartition("#")[2] in anchors,
                  f"rules.yml {r['alert']}: deploy/runbooks.md has no section "
                  f"{url.rpartition('#')[2]!r}")
    check(dashboard.get("uid") == "sparsebalance-planner", "the dashboard's uid must stay fixed")
    check(variables.get("datasource", {}).get("type") == "datasource", "no datasource variable")
    check("job" in variables, "no job variable")
    ids = [p["id"] for p in panels]
    check(len(ids) == len(set(ids)), "panel ids repeat")
    for p in panels:
        if p["type"] != "row":
            check(p.get("datasource", {}).get("uid") == "${datasource}",
                  f"panel {p['title']!r} does not use the datasource variable")

    # --- the entrypoint starts the real planner with the ConfigMap's settings ---------------------
    with tempfile.TemporaryDirectory() as tmp, sbdeploy.Processes() as procs:
        with open(f"{tmp}/admin-token", "w") as f:
            f.write("test-admin-token\n")
        run_env = dict(os.environ, SB_PLANNER_BIN=args.sb_planner)
        run_env.update({k: v for k, v in config.items()})
        run_env.update(SB_LISTEN="127.0.0.1:0", SB_METRICS_LISTEN="127.0.0.1:0",
                       SB_HEALTH_LISTEN=f"127.0.0.1:{sbdeploy.free_port()}",
                       SB_STATE_DIR=f"{tmp}/state", SB_ADMIN_TOKEN_FILE=f"{tmp}/admin-token",
                       SB_DRAIN_SECONDS="1")
        started = sbdeploy.start_planner(procs, ["bash", f"{DEPLOY}/docker/entrypoint.sh"],
                                         "deploy/docker/entrypoint.sh", env=run_env)

        def healthcheck():
            return subprocess.run(
                ["bash", f"{DEPLOY}/docker/healthcheck.sh"], capture_output=True, text=True,
                timeout=10, env=dict(os.environ, SB_HEALTH_BIN=args.sb_health or "sb-health",
                                     SB_LISTEN=started.grpc,
                                     SB_HEALTH_LISTEN=run_env["SB_HEALTH_LISTEN"]))
        if check(args.sb_health, "--sb-health is needed to run healthcheck.sh"):
            health = healthcheck()
            check(health.returncode == 0 and "SERVING" in health.stdout,
                  f"healthcheck.sh fails on the entrypoint's planner: {health.stdout}"
                  f"{health.stderr}")
        started.proc.send_signal(signal.SIGTERM)  # the entrypoint exec'd: the planner is this pid
        try:
            code = started.proc.wait(timeout=10)
            check(code == 0, f"the planner exited {code} on SIGTERM")
        except subprocess.TimeoutExpired:
            check(False, "the planner did not stop within 10 s of SIGTERM (entrypoint must exec)")
        if args.sb_health:
            health = healthcheck()
            check(health.returncode == 1,
                  f"healthcheck.sh passes with the planner stopped: {health.stdout}")

    sbdeploy.finish(failures, f"manifests consistent: {len(objects)} Kubernetes objects, "
                              f"{len(services)} compose services, {len(env_flags)} SB_* variables, "
                              f"{len(exprs)} PromQL expressions")


if __name__ == "__main__":
    main()
