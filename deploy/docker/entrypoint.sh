#!/bin/bash
# sb-planner's container entrypoint: turns SB_* environment variables into sb-planner flags and
# execs the planner (so that it is PID 1 and receives SIGTERM itself). An unset or empty variable
# leaves the flag at its default; arguments after the image name are passed on as more flags.
#   docker run -e SB_MAX_JOBS=64 sparsebalance/sb-planner:0.1.0 --fsync_reports
set -euo pipefail

planner=${SB_PLANNER_BIN:-/usr/local/bin/sb-planner}
args=()
flag() {  # flag VARIABLE FLAG_NAME: --FLAG_NAME=$VARIABLE when the variable is non-empty
  local value=${!1:-}
  if [ -n "$value" ]; then args+=("--$2=$value"); fi
}

flag SB_LISTEN listen
flag SB_METRICS_LISTEN metrics_listen
flag SB_STATE_DIR state_dir
flag SB_FSYNC_REPORTS fsync_reports
flag SB_ADMIN_TOKEN_FILE admin_token_file
flag SB_TLS_CERT tls_cert
flag SB_TLS_KEY tls_key
flag SB_TLS_CLIENT_CA tls_client_ca
flag SB_MAX_JOBS max_jobs
flag SB_MAX_SAMPLES max_samples
flag SB_MAX_WORLD_SIZE max_world_size
flag SB_MAX_MESSAGE_BYTES max_message_bytes
flag SB_MAX_REQUEST_MEMORY_MB max_request_memory_mb
flag SB_MAX_TRANSPORT_MEMORY_MB max_transport_memory_mb
flag SB_MAX_JOB_STATE_MB max_job_state_mb
flag SB_MAX_RANK_SERIES max_rank_series
flag SB_DRAIN_SECONDS drain_seconds
flag SB_HEALTH_LISTEN health_listen
flag SB_INSECURE_NO_ADMIN_TOKEN insecure_no_admin_token
flag SB_DRAIN_NOTICE_SECONDS drain_notice_seconds
flag SB_STATE_CHECK_SECONDS state_check_seconds
flag SB_MAX_WAITING_CALLS max_waiting_calls
flag SB_MAX_REPORT_STREAMS max_report_streams
flag SB_PLAN_THREADS plan_threads
flag SB_JOB_IDLE_TTL job_idle_ttl
flag SB_SLOW_RANK_SERIES slow_rank_series

exec "$planner" "${args[@]}" "$@"
