"""Launching a run: `jlong train --dry-run`, the launch scripts (SLURM's
environment faked, `jlong` replaced by a recorder), what a run prints at its
end, and what a finished run says when it is started again."""

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import REPO, logged_losses, run_cli, run_config

from jlong.config import config_to_dict

LAUNCH = REPO / "launch"

# The one-node config's model and length shrunk to what CPU devices compile in seconds; everything else is its own.
SHRUNK = [
    "model.vocab_size=256", "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
    "model.num_attention_heads=8", "model.num_key_value_heads=8", "model.head_dim=8",
    "train.seq_len=8192", "memory.mlp_tile=256", "memory.loss_tile=256",
]


def test_dry_run_of_the_one_node_config_says_what_the_run_would_do(tmp_path):
    tokens = tmp_path / "corpus.npy"
    np.save(tokens, np.arange(100_000, dtype=np.int32) % 256)
    run, checkpoints = tmp_path / "run", tmp_path / "ckpt"
    result = run_cli("train", REPO / "configs" / "llama3-8b-5m.yaml", *SHRUNK, f"data.path={tokens}",
                     f"run_dir={run}", f"checkpoint.dir={checkpoints}", "--dry-run")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "devices: 8 x cpu (cpu) in 1 process(es)" in out
    assert "mesh: data 1 x fsdp 1 x ring 1 x sp 8; 1,024 tokens of each sequence per device" in out
    assert f"data: {tokens}: 100,000 tokens, 12 sequences (in order); one pass is 12.0 steps" in out
    assert "steps: 1-100 of train.steps=100, 1 x 8,192 tokens each" in out
    assert f"metrics {run / 'metrics.jsonl'}" in out and f"loss curve {run / 'loss.png'}" in out
    assert f"checkpoints in {checkpoints} every 2 steps and at the end, keeping 2" in out
    # the planner's memory settings (memory.remat=auto, attention.heads_per_stage=auto), and their plan
    assert "memory choice: chosen: " in out and "device budget" in out
    assert not run.exists() and not checkpoints.exists()  # nothing written


@pytest.mark.fast
def test_dry_run_checks_the_data_as_the_run_would(tmp_path):
    result = run_cli("train", REPO / "configs" / "llama3-8b-5m.yaml", *SHRUNK,
                     f"data.path={tmp_path / 'missing.npy'}", "--dry-run")
    assert result.returncode == 2 and "does not exist; make one with 'jlong prepare'" in result.stderr


def _recorder(tmp_path: Path) -> tuple[dict, Path]:
    """An environment whose `jlong`, `srun` and `scontrol` only write down what they were asked."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    scripts = {
        # jlong: one line per process: its SLURM rank, its working directory, its arguments.
        "jlong": f'echo "${{SLURM_PROCID:-none}}|$PWD|$*" >> {calls}\n',
        # scontrol: the job's hosts, a line at a time (as a long list reaches a pipe in pieces).
        "scontrol": 'test "$1 $2 $3" = "show hostnames $SLURM_JOB_NODELIST" || exit 1\n'
                    'for host in gpu-a07 gpu-a08 gpu-b01 gpu-b02; do ((n++ < SLURM_NNODES)) || break; echo $host; '
                    'sleep 0.01; done\n',
        # srun: one task per node, each with its rank, as SLURM starts them.
        "srun": 'while [[ "$1" == --* ]]; do shift; done\n'
                'for ((i = 0; i < SLURM_NTASKS; i++)); do SLURM_PROCID=$i "$@" || exit 1; done\n',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "JLONG": str(bin_dir / "jlong")}
    return env, calls


def _sbatch_options(script: Path) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.read_text().splitlines() if line.startswith("#SBATCH ")]


@pytest.mark.fast
@pytest.mark.parametrize("script", sorted(p.name for p in LAUNCH.iterdir()))
def test_launch_scripts_parse(script):
    subprocess.run(["bash", "-n", str(LAUNCH / script)], check=True)


@pytest.mark.parametrize("script, nodes, config", [
    ("slurm_1node.sbatch", 1, "configs/llama3-8b-5m.yaml"),
    ("slurm_4nodes.sbatch", 4, "configs/llama3-8b-32m-4nodes.yaml"),
])
@pytest.mark.fast
def test_slurm_scripts_start_one_process_per_node_on_the_first_node_s_coordinator(tmp_path, script, nodes, config):
    env, calls = _recorder(tmp_path)
    env.update(SLURM_SUBMIT_DIR=str(REPO), SLURM_JOB_NODELIST="gpu-[a07-a08,b01-b02]", SLURM_NNODES=str(nodes),
               SLURM_NTASKS=str(nodes), SLURM_JOB_ID="73512")
    options = _sbatch_options(LAUNCH / script)
    assert f"--nodes={nodes}" in options and "--ntasks-per-node=1" in options and "--gpus-per-node=8" in options
    assert "--requeue" in options  # a preempted or failed job comes back and resumes from its checkpoint
    subprocess.run(["bash", str(LAUNCH / script)], env=env, check=True, cwd=tmp_path)
    lines = calls.read_text().splitlines()
    assert lines == [
        f"{rank}|{REPO}|train {config} --coordinator gpu-a07:33512 --num-processes {nodes} --process-id {rank}"
        for rank in range(nodes)
    ]
    assert (REPO / config).is_file()


@pytest.mark.fast
def test_slurm_time_limit_warning_stops_every_process_then_requeues_the_job(tmp_path):
    """SIGUSR1 to the batch script (SLURM's --signal=B:USR1@...): it signals
    the job's steps with SIGTERM (scancel, faked to signal the fake jlongs),
    waits for the processes to stop, and requeues the job."""
    bin_dir, calls, pids = tmp_path / "bin", tmp_path / "calls.txt", tmp_path / "pids"
    bin_dir.mkdir()
    pids.mkdir()
    fakes = {
        # jlong: runs until SIGTERM, then says so and exits 0, as a run that saved its checkpoint does.
        "jlong": f'trap \'echo "$SLURM_PROCID stopped" >> {calls}; exit 0\' TERM\n'
                 f'echo $$ > {pids}/tmp$SLURM_PROCID && mv {pids}/tmp$SLURM_PROCID {pids}/$SLURM_PROCID\n'
                 'while true; do sleep 0.05; done\n',
        "scontrol": f'if [ "$1" = requeue ]; then echo "scontrol $*" >> {calls}; else printf "gpu-a07\\ngpu-a08\\n"; fi\n',
        "scancel": f'echo "scancel $*" >> {calls}\nkill -TERM $(cat {pids}/*)\n',
        "srun": 'while [[ "$1" == --* ]]; do shift; done\n'
                'for ((i = 0; i < SLURM_NTASKS; i++)); do SLURM_PROCID=$i "$@" & done\nwait\n',
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "JLONG": str(bin_dir / "jlong"),
           "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_NODELIST": "gpu-[a07-a08]", "SLURM_NNODES": "2",
           "SLURM_NTASKS": "2", "SLURM_JOB_ID": "73512"}
    assert "--signal=B:USR1@10800" in _sbatch_options(LAUNCH / "slurm_1node.sbatch")
    job = subprocess.Popen(["bash", str(LAUNCH / "slurm_1node.sbatch")], env=env, cwd=tmp_path)
    deadline = time.monotonic() + 30
    while len([p for p in pids.iterdir() if p.name.isdigit()]) < 2:
        assert job.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    job.send_signal(signal.SIGUSR1)
    assert job.wait(timeout=30) == 0
    lines = calls.read_text().splitlines()
    assert lines[0] == "scancel --signal=TERM 73512"
    assert sorted(lines[1:3]) == ["0 stopped", "1 stopped"]
    assert lines[3:] == ["scontrol requeue 73512"]


@pytest.mark.fast
def test_slurm_script_passes_a_config_and_overrides_through(tmp_path):
    env, calls = _recorder(tmp_path)
    env.update(SLURM_SUBMIT_DIR=str(REPO), SLURM_JOB_NODELIST="gpu-a07", SLURM_NNODES="1", SLURM_NTASKS="1",
               SLURM_JOB_ID="5", JLONG_PORT="4242")
    subprocess.run(["bash", str(LAUNCH / "slurm_1node.sbatch"), "configs/tiny.yaml", "train.steps=3"], env=env,
                   check=True, cwd=tmp_path)
    assert calls.read_text().splitlines() == [
        f"0|{REPO}|train configs/tiny.yaml --coordinator gpu-a07:4242 --num-processes 1 --process-id 0 train.steps=3"
    ]


@pytest.mark.fast
def test_one_node_script_runs_the_venv_jlong_from_the_repository(tmp_path):
    env, calls = _recorder(tmp_path)
    subprocess.run([str(LAUNCH / "one_node.sh"), "configs/llama3-8b-5m.yaml", "--dry-run"], env=env, check=True,
                   cwd=tmp_path)
    assert calls.read_text().splitlines() == [f"none|{REPO}|train configs/llama3-8b-5m.yaml --dry-run"]


def test_a_run_ends_with_a_summary_and_a_loss_curve_and_a_finished_run_says_so(tmp_path):
    config = run_config(tmp_path)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config_to_dict(config)))
    result = run_cli("train", config_file)
    assert result.returncode == 0, result.stderr
    losses = logged_losses(tmp_path / "run")
    lines = result.stdout.strip().splitlines()[-6:]
    assert lines[0].startswith("trained steps 1-6 of 6 in ") and "tokens/s" in lines[0]
    assert lines[1] == f"  loss         {losses[0]:.4f} at step 1 -> {losses[-1]:.4f} at step 6"
    assert lines[2:5] == [f"  metrics      {tmp_path / 'run' / 'metrics.jsonl'}",
                          f"  loss curve   {tmp_path / 'run' / 'loss.png'}",
                          f"  config       {tmp_path / 'run' / 'config.yaml'}"]
    assert lines[5] == f"  checkpoints  {tmp_path / 'ckpt'} (newest: step 6)"
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    metrics = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    again = run_cli("train", config_file)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == (
        f"run_dir {str(tmp_path / 'run')!r} already finished: step 6 of train.steps=6 is checkpointed; to train on, "
        "raise train.steps (e.g. train.steps=12), or choose a new run_dir and checkpoint.dir to start over"
    )
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == metrics
    partial = run_cli("train", config_file, "train.steps=6", "--until-step", "4")
    assert "is already at step 6, past --until-step 4; nothing to train" in partial.stdout
