#!/bin/bash
# One SLURM task = one jlong process (one per node, owning the node's GPUs).
# srun starts it on every node; it finds the coordinator (the job's first
# node), its process id (SLURM_PROCID) and the process count (SLURM_NTASKS),
# and runs the repository venv's jlong.
#   srun launch/slurm_process.sh CONFIG.yaml [key=value ...]
set -euo pipefail
: "${SLURM_JOB_NODELIST:?run me under srun}" "${SLURM_PROCID:?}" "${SLURM_NTASKS:?}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
jlong="${JLONG:-${JLONG_VENV:-$repo/.venv}/bin/jlong}"
config="${1:?usage: slurm_process.sh CONFIG.yaml [key=value ...]}"
shift
# Read every host name: `| head -n 1` under pipefail fails whenever head closes the pipe before scontrol
# has written its last line.
mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
coordinator_host="${hosts[0]:?scontrol show hostnames gave no host for $SLURM_JOB_NODELIST}"
# A port of the job's own, so that two jobs sharing a first node do not collide.
port="${JLONG_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}"
cd "$repo"
exec "$jlong" train "$config" \
    --coordinator "$coordinator_host:$port" --num-processes "$SLURM_NTASKS" --process-id "$SLURM_PROCID" "$@"
