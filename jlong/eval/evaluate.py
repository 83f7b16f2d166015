"""`jlong eval` and `train.eval_every`: the run's forward pass only, on its
mesh and attention layout, scoring held-out tokens by position and passkey
retrieval (`jlong.eval.positions`, `jlong.eval.passkey`)."""

from __future__ import annotations

import math

import numpy as np
from jax.experimental import multihost_utils

from jlong.checkpoint import Checkpoints, saved_steps, weights_kind
from jlong.config import Config
from jlong.config.stages import config_at_step
from jlong.data.prepare import Encoder
from jlong.data.sources import TokenFile, batch_layout, document_structure
from jlong.errors import JlongError
from jlong.eval import passkey
from jlong.eval.positions import loss_by_position
from jlong.attention.methods import method_of
from jlong.program.train_program import TrainProgram


class Evaluator:
    """Scores [N, S + 1] token rows with a program's forward pass, a batch at a time."""

    def __init__(self, program: TrainProgram):
        self.program, self.config = program, program.config
        self.layout = method_of(self.config).layout(self.config)
        self.keys = batch_layout(self.config)
        self.compiled = None

    def scores(self, params: dict, rows: np.ndarray) -> np.ndarray:
        """[N, S, 2]: each target token's cross-entropy and argmax hit, in sequence order."""
        if self.compiled is None:
            self.compiled = self.program.lower_eval().compile()
        B, count = self.config.train.batch_size, len(rows)
        padded = np.concatenate([rows, np.repeat(rows[-1:], -count % B, axis=0)])  # whole batches
        out = []
        for first in range(0, len(padded), B):
            batch = self._batch(padded[first : first + B])
            scored = self.compiled(params, self.program.place_batch(batch))
            out.append(self.layout.restore(np.asarray(multihost_utils.process_allgather(scored, tiled=True))))
        return np.concatenate(out)[:count]

    def _batch(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        arrays = {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
        arrays.update(positions_of(arrays["inputs"], self.config.data.eos_id))
        return {key: arrays[key] for key in self.keys}


def positions_of(inputs: np.ndarray, eos_id: int | None) -> dict[str, np.ndarray]:
    """Where each input token sits in what attention sees (and the segments, when packed)."""
    if eos_id is not None:
        return document_structure(inputs, eos_id)
    return {"positions": np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int32), inputs.shape)}


def held_out_rows(config: Config) -> np.ndarray:
    """The first eval.sequences windows of eval.path (fewer if it holds fewer)."""
    if not config.eval.path:
        raise JlongError("the loss by position needs held-out tokens: set eval.path (a .npy made by 'jlong prepare')")
    source = TokenFile(config.eval.path, seq_len=config.train.seq_len, batch_size=1,
                       vocab_size=config.model.vocab_size, setting="eval.path")
    return np.stack([source.window(i) for i in range(min(config.eval.sequences, source.num_samples))])


def position_losses(evaluator: Evaluator, params: dict, rows: np.ndarray) -> dict:
    """The whole loss of the rows and its buckets by position."""
    losses = evaluator.scores(params, rows)[..., 0]
    positions = positions_of(rows[:, :-1], evaluator.config.data.eos_id)["positions"]
    return {"loss": float(losses.astype(np.float64).mean()), "tokens": int(losses.size),
            "loss_by_position": loss_by_position(losses, positions, evaluator.config.train.seq_len)}


def passkey_trials(config: Config) -> list:
    """The passkey prompts of eval.passkey_*, checked against the model and the length (none when 0 trials)."""
    if not config.eval.passkey_trials:
        return []
    encode = _text_encoder(config)
    shortest = passkey.shortest_prompt(encode)
    lengths = config.eval.passkey_lengths or passkey.default_lengths(config.train.seq_len, shortest)
    if not lengths:
        raise JlongError(f"a passkey prompt needs {shortest} tokens, more than train.seq_len "
                         f"({config.train.seq_len}): set eval.passkey_trials=0")
    return passkey.trials(encode, config.train.seq_len, lengths, config.eval.passkey_depths,
                          config.eval.passkey_trials, config.train.seed)


def passkey_accuracy(evaluator: Evaluator, params: dict, made: list | None = None) -> list[dict]:
    """Accuracy per (length, depth) cell of the trials `made` (by default, the config's)."""
    made = passkey_trials(evaluator.config) if made is None else made
    if not made:
        return []
    hits = evaluator.scores(params, np.stack([t.row for t in made]))[..., 1]
    return passkey.accuracy(made, hits)


def _text_encoder(config: Config):
    if config.eval.tokenizer:
        return Encoder.load(config.eval.tokenizer, eos_id=0).encode  # the prompts need no end id
    if config.model.vocab_size < 256:
        raise JlongError("passkey retrieval writes text: set eval.tokenizer (the model's tokenizer.json), or "
                         "eval.passkey_trials=0 (byte-level text needs model.vocab_size >= 256)")
    return lambda text: list(text.encode("utf-8"))


def checkpoint_kind(checkpoint: str) -> str:
    """"hf" or "jlong", checked before anything is built."""
    return weights_kind(checkpoint, "--checkpoint")


def at_checkpoint(config: Config, checkpoint: str, overrides: list[str] = ()) -> Config:
    """The config to evaluate `checkpoint` with: a run in stages is evaluated
    with the settings of the stage its checkpoint's step belongs to (a
    Hugging Face checkpoint: the last stage's), `overrides` over them."""
    kind = checkpoint_kind(checkpoint)
    step = saved_steps(checkpoint)[-1] if kind == "jlong" else config.train.steps
    return config_at_step(config, step, overrides)


def load_params(program: TrainProgram, checkpoint: str) -> tuple[dict, int | str]:
    """The parameters of a jlong checkpoint directory (its newest step) or a
    Hugging Face directory, in the program's shardings; and which step."""
    if checkpoint_kind(checkpoint) == "hf":
        return program.load_hf_params(checkpoint), "hf"
    checkpoints = Checkpoints(checkpoint)
    try:
        step = checkpoints.latest_step()
        checkpoints.check_layout(step, {"params": program.abstract_params},
                                 "evaluate it with the model settings it was trained with (a run's own config is "
                                 "run_dir/config.yaml)")
        params, _ = checkpoints.restore(step, program.abstract_params)
    finally:
        checkpoints.close()
    return params, step


def eval_inputs(config: Config) -> tuple[np.ndarray | None, list]:
    """The held-out rows (None without eval.path) and the passkey trials, read and checked."""
    if not config.eval.path and not config.eval.passkey_trials:
        raise JlongError("nothing to evaluate: set eval.path, or eval.passkey_trials above 0")
    return (held_out_rows(config) if config.eval.path else None), passkey_trials(config)


def evaluate(config: Config, checkpoint: str, mesh, inputs: tuple | None = None) -> dict:
    """The loss by position on eval.path and the passkey cells, of a checkpoint on `mesh`
    (`inputs`: what `eval_inputs` gave, when the caller checked them first)."""
    rows, made = inputs or eval_inputs(config)
    program = TrainProgram(config, mesh)
    params, step = load_params(program, checkpoint)
    evaluator = Evaluator(program)
    result = {"checkpoint": str(checkpoint), "step": step, "seq_len": config.train.seq_len}
    if rows is not None:
        result.update(position_losses(evaluator, params, rows))
    result["passkey"] = passkey_accuracy(evaluator, params, made)
    return result


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))

