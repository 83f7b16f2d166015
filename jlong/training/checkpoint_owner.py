"""Whose checkpoints a checkpoint.dir holds, checked before a run reads,
writes or prunes anything there.

The run that saves into a directory records its config beside the steps
(`jlong.checkpoint.RUN_RECORD`). A later run with the same mathematics
resumes from them, whatever its run_dir says (a moved run, a new mesh); one
with other mathematics is refused in one line, and the directory is left
exactly as it was: `checkpoint.keep` would otherwise delete the earlier
run's checkpoints as the new run saved its own. A LoRA run's checkpoints
hold its adapters, not its base: they record the digest of the base's
files, and a resume over a base whose files changed is refused too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from jlong.checkpoint import RUN_RECORD, Checkpoints, check_lora_base, lora_base_digest, read_run_record, saved_steps
from jlong.config import Config, config_to_dict
from jlong.config.identity import changes
from jlong.errors import JlongError


@dataclass(frozen=True)
class Owner:
    """What a run found in its checkpoint.dir."""

    newest: int  # the newest trained step there (0: none)
    note: str | None  # a line to say before starting, when something is worth knowing


def check_owner(config: Config) -> Owner:
    """Refuses a checkpoint.dir written by a run of other mathematics; touches nothing."""
    directory = Path(config.checkpoint.dir)
    steps = saved_steps(directory)
    trained = [s for s in steps if s > 0]
    if steps and not trained:  # `jlong convert`'s output: weights at step 0, no optimizer state
        raise JlongError(
            f"checkpoint.dir {str(directory)!r} holds converted weights (step 0), not a run's checkpoints: "
            f"convert it to a Hugging Face directory for model.hf_path ('jlong convert {directory} HF_DIR'), "
            "and give the run a checkpoint.dir of its own"
        )
    record = read_run_record(directory)
    if not trained:
        return Owner(0, None)
    if record is None:
        return Owner(trained[-1], f"checkpoint.dir {str(directory)!r} has no record of the run that wrote it "
                                  f"(written before jlong kept one): resuming without checking its settings")
    found = changes(record, config_to_dict(config))
    if found.refused:
        raise JlongError(
            f"checkpoint.dir {str(directory)!r} holds another run's checkpoints (newest: step {trained[-1]}), "
            f"written with other settings: {found.named(found.refused)}; resume with that run's settings "
            f"({directory / RUN_RECORD}), or choose a new checkpoint.dir to start over"
        )
    return Owner(trained[-1], None)


def check_lora_base_of(config: Config, newest: int, say) -> str | None:
    """A LoRA run's base digest (None without LoRA, or for a base from the seed), refused in one line when
    the run resumes (`newest` > 0) over a base whose files changed since its checkpoints were written."""
    if config.lora is None:
        return None
    if not newest:
        return lora_base_digest(config.model.hf_path)
    checkpoints = Checkpoints(config.checkpoint.dir)
    try:
        meta = checkpoints.meta(newest)
    finally:
        checkpoints.close()
    return check_lora_base(meta, config.model.hf_path, f"checkpoint.dir {config.checkpoint.dir!r} (step {newest})",
                           "restore that base to resume, or choose a new checkpoint.dir to adapt this one", say)
