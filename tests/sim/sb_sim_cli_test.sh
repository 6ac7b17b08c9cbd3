#!/usr/bin/env bash
# sb-sim as a user runs it: --help lists every flag, bad input is a clear error (exit 2), and
# the report files are written and well-formed. Usage: sb_sim_cli_test.sh PATH/TO/sb-sim
set -euo pipefail
sim=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

help=$("$sim" --help || true)  # Abseil ends --help with exit 1
for flag in trace pack ranks micro_batches capacity fill steps policies mode slow_ranks \
            slow_factor noise seed json svg profile density density_min layers heads head_dim \
            block local_blocks attention_ratio cost_truth sensitivity_prior recall_rows \
            bucket_recall_margin document_recall_floor; do
  grep -q -- "--$flag" <<<"$help" || fail "--help does not document --$flag"
done

expect_error() {  # expect_error SUBSTRING ARGS...: exit 2 and the message names SUBSTRING
  local want=$1; shift
  set +e; out=$("$sim" "$@" 2>&1); rc=$?; set -e
  [ "$rc" -eq 2 ] || fail "sb-sim $* exited $rc, want 2: $out"
  grep -q -- "$want" <<<"$out" || fail "sb-sim $* said '$out', want it to name '$want'"
}
expect_error "unknown flag --bogus" --bogus=1
expect_error "--ranks=abc" --ranks=abc
expect_error "spelled with '_': --micro_batches" --micro-batches=2
expect_error "unexpected argument \"extra\"" --ranks=4 extra
expect_error "--steps needs a value" --steps
expect_error "unknown policy" --policies=sequential,nope
expect_error "quantile" --mode=quantile:2
expect_error "--cost_truth=cubic" --cost_truth=cubic
expect_error "--sensitivity_prior=noisy:-1" --sensitivity_prior=noisy:-1
expect_error "--recall_rows" --recall_rows=0
# A guard outside the planner's range is the planner's config error (exit 1), naming the field.
if out=$("$sim" --bucket_recall_margin=2 --steps=1 2>&1); then fail "--bucket_recall_margin=2 ran"; fi
grep -q "config.bucket_recall_margin" <<<"$out" || fail "--bucket_recall_margin=2 said '$out'"
grep -q "recall_true(rho) = a + (1 - a - m) x^beta" <<<"$help" || fail "--help lacks the recall truth"
printf '4096\n# comment\n8192 0.5\nabc\n' > "$tmp/trace.txt"
expect_error "trace line 4" --trace="$tmp/trace.txt"
expect_error "neither a built-in trace" --trace="$tmp/missing.txt"

# A file trace runs (--flag value works too), and the JSON and SVG come out well-formed.
printf '4096\n8192 0.5\n16384 0.1 8192:8192\n' > "$tmp/good.txt"
"$sim" --trace="$tmp/good.txt" --ranks=4 --micro_batches=2 --capacity=32768 --steps 3 \
  --sensitivity_prior=noisy:0.1 --json="$tmp/r.json" --svg="$tmp/r.svg" >/dev/null
/usr/bin/python3 - "$tmp/r.json" "$tmp/r.svg" <<'PY'
import json, sys, xml.dom.minidom
report = json.load(open(sys.argv[1]))
assert len(report["results"]) == 6, report["results"]
assert report["scenario"]["ranks"] == 4
assert report["scenario"]["sensitivity_prior"] == "noisy:0.1", report["scenario"]
for result in report["results"]:
    assert [b["label"] for b in result["buckets"]] == ["<512", "512-2K", "2K-8K", "8K+"], result
    tokens = sum(b["tokens"] for b in result["buckets"])
    mean = sum(b["tokens"] * b["true_recall"] for b in result["buckets"]) / tokens
    assert abs(mean - result["mean_recall"]) < 1e-9, (mean, result["mean_recall"])
xml.dom.minidom.parse(sys.argv[2])
PY
echo "sb-sim CLI: ok"
