#!/bin/bash
# The image's HEALTHCHECK: liveness, i.e. "the planner process answers gRPC health", with
# sb-health (one grpc.health.v1 Check, exit 0 when SERVING) for service "" on the health-only
# listener SB_HEALTH_LISTEN (the image sets 0.0.0.0:50152; a wildcard host means this machine).
#
# Why "" and why that listener: a drain is not a crash. On SIGTERM the planner turns
# sparsebalance.planner.v1.PlannerService NOT_SERVING (readiness: load balancers and Kubernetes
# move traffic away) and closes SB_LISTEN after SB_DRAIN_NOTICE_SECONDS, but "" on the health
# listener stays SERVING until the process exits, so Docker never marks a draining planner
# unhealthy (nor restarts it, under an orchestrator that restarts unhealthy containers). Nor does
# an unwritable state directory make it unhealthy: a restart would not fix it; it shows as
# readiness NOT_SERVING and sparsebalance_state_dir_writable 0. Readiness by hand:
#   sb-health --address=127.0.0.1:50152 --service=sparsebalance.planner.v1.PlannerService
# Without SB_HEALTH_LISTEN this probes SB_LISTEN (plaintext only; fails late in a drain).
set -uo pipefail

probe=${SB_HEALTH_BIN:-/usr/local/bin/sb-health}
address=${SB_HEALTH_LISTEN:-${SB_LISTEN:-127.0.0.1:50151}}
exec "$probe" --address="$address" --service= --timeout_seconds=3
