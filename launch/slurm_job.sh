#!/bin/bash
# The body of the sbatch scripts: one jlong process per node under srun, and
# SLURM's warnings turned into a clean stop.
#   launch/slurm_job.sh CONFIG.yaml [key=value ...]   (run by an sbatch script, in the repository)
# - Before the time limit SLURM sends SIGUSR1 to this script (#SBATCH
#   --signal=B:USR1@SECONDS: give more than a step and its checkpoint take,
#   or the warning comes too late). It sends SIGTERM to every jlong process, which
#   finish their step, agree where to stop, write one checkpoint and exit 0;
#   then it requeues the job, which resumes from that checkpoint.
# - On preemption SLURM sends SIGTERM to every process itself, the processes
#   stop the same way, and SLURM requeues the job (#SBATCH --requeue). The
#   stop is saved only if the step and its checkpoint end within the
#   cluster's grace time; otherwise the newest checkpoint stands.
set -euo pipefail
: "${SLURM_JOB_ID:?run me from an sbatch script}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
warned=0
trap 'warned=1; scancel --signal=TERM "$SLURM_JOB_ID"' USR1
trap ':' TERM  # preempted: the jlong processes got it too; wait while they save
srun --kill-on-bad-exit=1 "$here/slurm_process.sh" "$@" &
srun_pid=$!
while true; do
    wait "$srun_pid" && status=0 || status=$?
    kill -0 "$srun_pid" 2>/dev/null || break  # srun has ended; otherwise a signal only interrupted the wait
done
if ((warned && status == 0)); then
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
