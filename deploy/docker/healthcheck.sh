#!/bin/bash
# Container health check for sb-planner (the image has no gRPC health client): the metrics
# endpoint answers with sb-planner's metrics, and the gRPC port accepts a TCP connection. Reads
# the ports from SB_METRICS_LISTEN and SB_LISTEN (as the entrypoint does). Exit 0 = healthy.
set -uo pipefail

host_of() {  # the address to connect to for a listen address: 0.0.0.0 / [::] -> loopback
  local host=${1%:*}
  case "$host" in "" | 0.0.0.0 | "[::]" | "::") echo 127.0.0.1 ;; *) echo "${host#[}" | tr -d ']' ;; esac
}
metrics=${SB_METRICS_LISTEN:-127.0.0.1:9151}
grpc=${SB_LISTEN:-127.0.0.1:50151}

if ! timeout 3 bash -c '
  exec 3<>"/dev/tcp/$1/$2" || exit 1
  printf "GET /metrics HTTP/1.0\r\nHost: %s\r\n\r\n" "$1" >&3
  reply=$(cat <&3)
  [[ $reply == "HTTP/1."?" 200"* && $reply == *sparsebalance_build_info* ]]
' sb-planner-healthcheck "$(host_of "$metrics")" "${metrics##*:}"; then
  echo "sb-planner-healthcheck: no sparsebalance metrics on http://$metrics/metrics" >&2
  exit 1
fi
if ! timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2"' sb-planner-healthcheck "$(host_of "$grpc")" "${grpc##*:}"; then
  echo "sb-planner-healthcheck: gRPC port $grpc refuses connections" >&2
  exit 1
fi
exit 0
