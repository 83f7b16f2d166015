#!/bin/bash
# One node, one process, all of its GPUs: trains CONFIG with the repository's venv.
#   launch/one_node.sh configs/llama3-8b-5m.yaml [key=value ...] [--dry-run]
# Running it again after a crash resumes from the newest checkpoint in checkpoint.dir.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
jlong="${JLONG:-${JLONG_VENV:-$repo/.venv}/bin/jlong}"
config="${1:?usage: one_node.sh CONFIG.yaml [key=value ...] [--dry-run]}"
shift
cd "$repo"
exec "$jlong" train "$config" "$@"
