#!/usr/bin/env bash
# Pins container images by digest, where a registry is reachable (the machine that wrote the
# pins had none: they come from public sources, cited next to each).
#
#   scripts/pin-images.sh [--check]
#       every IMAGE:TAG@sha256:DIGEST in deploy/docker/Dockerfile and deploy/compose.yaml gets
#       the digest IMAGE:TAG names today (the multi-platform index). --check changes nothing and
#       exits 1 when a pin is stale. Review the diff (and update the cited source) and commit.
#   scripts/pin-images.sh --kustomize REGISTRY/sb-planner:TAG
#       after pushing the planner's image: deploy/k8s/kustomization.yaml deploys it by digest
#       (newName and digest instead of newTag).
#
# Resolves with the first of crane, skopeo, regctl, docker buildx imagetools it finds.
set -euo pipefail
cd "$(dirname "$0")/.."

digest_of() {  # digest_of IMAGE:TAG -> sha256:... of its manifest (list)
  local ref=$1
  if command -v crane >/dev/null; then
    crane digest "$ref"
  elif command -v skopeo >/dev/null; then
    echo "sha256:$(skopeo inspect --raw "docker://$ref" | sha256sum | cut -d' ' -f1)"
  elif command -v regctl >/dev/null; then
    regctl image digest "$ref"
  elif docker buildx version >/dev/null 2>&1; then
    docker buildx imagetools inspect "$ref" --format '{{.Manifest.Digest}}'
  else
    echo "pin-images.sh: needs crane, skopeo, regctl or docker buildx" >&2
    exit 2
  fi
}

if [ "${1:-}" = "--kustomize" ]; then
  ref=${2:?"usage: pin-images.sh --kustomize REGISTRY/IMAGE:TAG"}
  digest=$(digest_of "$ref")
  python3 - deploy/k8s/kustomization.yaml "${ref%:*}" "$digest" <<'PY'
import re, sys
path, name, digest = sys.argv[1:]
text = open(path).read()
entry = re.compile(r"(  - name: sparsebalance/sb-planner\n)(    \w+: .*\n)+")
if not entry.search(text):
    sys.exit(f"pin-images.sh: no sparsebalance/sb-planner entry under images: in {path}")
text = entry.sub(lambda m: m.group(1) + f"    newName: {name}\n    digest: {digest}\n", text)
open(path, "w").write(text)
PY
  echo "pin-images.sh: deploy/k8s/kustomization.yaml deploys ${ref%:*}@$digest ($ref)"
  exit 0
fi

check=0
[ "${1:-}" = "--check" ] && check=1
stale=0
for file in deploy/docker/Dockerfile deploy/compose.yaml; do
  while read -r pinned; do
    ref=${pinned%@*}
    old=${pinned#*@}
    new=$(digest_of "$ref")
    if [ "$new" = "$old" ]; then
      echo "pin-images.sh: $file: $ref is current"
    elif [ "$check" = 1 ]; then
      echo "pin-images.sh: $file: $ref is $new now, pinned $old" >&2
      stale=1
    else
      sed -i "s|$ref@$old|$ref@$new|g" "$file"
      echo "pin-images.sh: $file: $ref $old -> $new"
    fi
  done < <(grep -oE '[a-z0-9./_-]+:[A-Za-z0-9._-]+@sha256:[0-9a-f]{64}' "$file" | sort -u)
done
exit "$stale"
