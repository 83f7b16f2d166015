"""`jlong eval` and `train.eval_every`: the run's forward pass only, on its
mesh and attention layout, scoring held-out tokens by position and passkey
retrieval (`jlong.eval.positions`, `jlong.eval.passkey`)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax.experimental import multihost_utils

from jlong.checkpoint import Checkpoints, check_lora_base, saved_steps, stderr_note, weights_kind
from jlong.config import Config
from jlong.config.stages import config_at_step
from jlong.data.encoder import Encoder
from jlong.data.sources import TokenFile, document_structure
from jlong.errors import JlongError
from jlong.config.huggingface import hf_stop_ids
from jlong.eval import passkey
from jlong.eval.answers import answer_accuracy, answer_trials
from jlong.eval.positions import loss_by_position
from jlong.objectives.dpo_reference import held_out_metrics, held_out_reference
from jlong.attention.methods import method_of
from jlong.planner.memory_choice import frugal
from jlong.program.train_program import TrainProgram


class Evaluator:
    """Scores [N, S + 1] token rows with a program's forward pass, a batch at a time."""

    def __init__(self, program: TrainProgram):
        self.program, self.config = program, program.config
        self.layout = method_of(self.config).layout(self.config)
        self.keys = program.abstract_eval_batch
        self.compiled = None

    def scores(self, params: dict, rows: np.ndarray, eos_ids: np.ndarray | None = None) -> np.ndarray:
        """[N, S, 2]: each target token's cross-entropy and argmax hit, in sequence order
        (`eos_ids`: [N, 1] each row's end-of-document id; default data.eos_id)."""
        if self.compiled is None:
            self.compiled = self.program.lower_eval().compile()
        B, count = self.config.train.batch_size, len(rows)
        eos_ids = np.full((count, 1), _run_eos_id(self.config)) if eos_ids is None else eos_ids
        fill = -count % B  # whole batches: the last row again
        rows, eos_ids = (np.concatenate([a, np.repeat(a[-1:], fill, axis=0)]) for a in (rows, eos_ids))
        out = []
        for first in range(0, len(rows), B):
            batch = self._batch(rows[first : first + B], eos_ids[first : first + B])
            scored = self.compiled(params, self.program.place_batch(batch))
            out.append(self.layout.restore(np.asarray(multihost_utils.process_allgather(scored, tiled=True))))
        return np.concatenate(out)[:count]

    def _batch(self, rows: np.ndarray, eos_ids: np.ndarray) -> dict[str, np.ndarray]:
        arrays = {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
        arrays.update(positions_of(arrays["inputs"], eos_ids if self.config.data.eos_id is not None else None))
        arrays["loss_mask"] = np.ones(arrays["targets"].shape, bool)  # the program's input; scores ignore it
        return {key: arrays[key] for key in self.keys}


def positions_of(inputs: np.ndarray, eos_id) -> dict[str, np.ndarray]:
    """Where each input token sits in what attention sees (and the segments, when packed;
    `eos_id`: one id, [B, 1] ids, or None)."""
    if eos_id is not None:
        return document_structure(inputs, eos_id)
    return {"positions": np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int32), inputs.shape)}


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """Held-out rows to score, and where each came from."""

    rows: np.ndarray  # [N, S + 1] ids
    source: np.ndarray  # [N] each row's index into names
    names: tuple[str, ...]  # eval.mix's entries (one, unnamed, for eval.path)
    eos_ids: np.ndarray  # [N, 1] each row's end-of-document id (-1: none)
    trained: np.ndarray  # [N, S + 1] which ids count (a token file's mask, `jlong prepare --chat`; else all)


def held_out_rows(config: Config) -> HeldOut:
    """The first eval.sequences windows of eval.path (fewer if it holds fewer),
    or of eval.mix's corpora, split between them by weight (at least one each)."""
    if not config.eval.held_out:
        raise JlongError("the loss by position needs held-out tokens: set eval.path (a .npy made by 'jlong prepare') "
                         "or eval.mix")
    default_eos = _run_eos_id(config)
    if config.eval.path:
        rows, trained = _windows(config, config.eval.path, "eval.path", config.eval.sequences)
        _check_counted(trained, "eval.path")
        return HeldOut(rows, np.zeros(len(rows), np.int64), ("eval.path",), np.full((len(rows), 1), default_eos),
                       trained)
    entries = config.eval.mix_sources
    counts = sequences_per_source([e.weight for e in entries], config.eval.sequences)
    parts = [_windows(config, e.path, f"eval.mix[{i}].path", n) for i, (e, n) in enumerate(zip(entries, counts))]
    for i, (_, trained) in enumerate(parts):
        _check_counted(trained, f"eval.mix[{i}].path")
    eos = [default_eos if e.eos_id is None else e.eos_id for e in entries]
    sources = np.repeat(np.arange(len(parts)), [len(rows) for rows, _ in parts])
    return HeldOut(np.concatenate([rows for rows, _ in parts]), sources, tuple(e.label for e in entries),
                   np.array(eos)[sources, None], np.concatenate([trained for _, trained in parts]))


def _check_counted(trained: np.ndarray, setting: str) -> None:
    if not trained[:, 1:].any():
        raise JlongError(f"the held-out windows of {setting} hold no trained token (its mask marks none there): "
                         "hold out conversations with assistant turns, or more of them (eval.sequences)")


def _run_eos_id(config: Config) -> int:
    """data.eos_id, or -1 (matching no id) without one."""
    return -1 if config.data.eos_id is None else config.data.eos_id


def _windows(config: Config, path, setting: str, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The first `count` windows of a token corpus and which of their ids are trained."""
    source = TokenFile(path, seq_len=config.train.seq_len, batch_size=1, vocab_size=config.model.vocab_size,
                       setting=setting)
    windows = range(min(count, source.num_samples))
    return np.stack([source.row(i) for i in windows]), np.stack([source.trained_row(i) for i in windows])


def sequences_per_source(weights: list[float], total: int) -> list[int]:
    """`total` rows split in proportion to `weights` (largest remainders), at least one each."""
    shares = np.asarray(weights, np.float64) / sum(weights) * total
    counts = np.floor(shares).astype(np.int64)
    for i in np.argsort(-(shares - counts), kind="stable")[: total - int(counts.sum())]:
        counts[i] += 1
    return [max(1, int(n)) for n in counts]


def position_losses(evaluator: Evaluator, params: dict, held: HeldOut) -> dict:
    """The whole loss of the rows' trained tokens, its buckets by position, and (for eval.mix) each source's loss."""
    losses = evaluator.scores(params, held.rows, held.eos_ids)[..., 0].astype(np.float64)
    eos_ids = held.eos_ids if evaluator.config.data.eos_id is not None else None
    positions = positions_of(held.rows[:, :-1], eos_ids)["positions"]
    counted = held.trained[:, 1:]  # a target counts where its id is trained
    result = {"loss": float(losses[counted].mean()), "tokens": int(counted.sum()),
              "loss_by_position": loss_by_position(losses[counted], positions[counted], evaluator.config.train.seq_len)}
    if evaluator.config.eval.mix:
        result["loss_by_source"] = {name: float(losses[(held.source == i)[:, None] & counted].mean())
                                    for i, name in enumerate(held.names)}
    return result


def passkey_trials(config: Config) -> list:
    """The passkey prompts of eval.passkey_*, checked against the model and the length (none when 0 trials)."""
    if not config.eval.passkey_trials:
        return []
    encode = _text_encoder(config)
    digits = config.eval.passkey_digits
    shortest = passkey.shortest_prompt(encode, digits)
    lengths = config.eval.passkey_lengths or passkey.default_lengths(config.train.seq_len, shortest)
    if not lengths:
        raise JlongError(f"a passkey prompt needs {shortest} tokens, more than train.seq_len "
                         f"({config.train.seq_len}): set eval.passkey_trials=0")
    return passkey.trials(encode, config.train.seq_len, lengths, config.eval.passkey_depths,
                          config.eval.passkey_trials, config.train.seed, digits)


def not_evaluated(config: Config) -> list[dict]:
    """What `jlong eval` leaves out under `config`, and why: [{what, why}]."""
    left_out = []
    if not config.eval.held_out:
        left_out.append({"what": "loss by position", "why": "no held-out tokens: set eval.path (a .npy made by "
                                                           "'jlong prepare') or eval.mix"})
    if not config.eval.passkey_trials:
        left_out.append({"what": "passkey retrieval", "why": "eval.passkey_trials=0"})
    elif not config.eval.passkey_lengths:
        seq_len = config.train.seq_len
        shortest = passkey.shortest_prompt(_text_encoder(config), config.eval.passkey_digits)
        if short := [n for n in passkey.candidate_lengths(seq_len) if n < shortest]:
            left_out.append({"what": f"passkey lengths {', '.join(f'{n:,}' for n in short)}",
                             "why": f"a prompt needs {shortest:,} tokens (the default lengths are seq_len / 8, / 4, "
                                    "/ 2 and seq_len; a longer train.seq_len reaches more)"})
    return left_out


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
    Hugging Face checkpoint: the last stage's), `overrides` over them; auto
    memory settings at their most frugal (a forward pass keeps nothing for a backward one)."""
    kind = checkpoint_kind(checkpoint)
    step = saved_steps(checkpoint)[-1] if kind == "jlong" else config.train.steps
    return frugal(config_at_step(config, step, overrides))


def load_params(program: TrainProgram, checkpoint: str) -> tuple[dict, int | str]:
    """The parameters of a jlong checkpoint directory (its newest step) or a
    Hugging Face directory, in the program's shardings; and which step."""
    if checkpoint_kind(checkpoint) == "hf":
        return program.load_hf_params(checkpoint), "hf"
    checkpoints = Checkpoints(checkpoint)
    try:  # a LoRA run's checkpoint holds its adapters; its base is read from where the run read it
        step = checkpoints.latest_step()
        checkpoints.check_layout(step, {"params": program.abstract_saved_params},
                                 "evaluate it with the model settings it was trained with (a run's own config is "
                                 "run_dir/config.yaml)")
        if program.lora:
            check_lora_base(checkpoints.meta(step), program.config.model.hf_path,
                            f"checkpoint step {step} in {str(checkpoint)!r}", "restore that base to evaluate it",
                            stderr_note)
        saved, _ = checkpoints.restore(step, program.abstract_saved_params)
    finally:
        checkpoints.close()
    return (program.with_saved(program.starting_params(), saved) if program.lora else saved), step


def eval_inputs(config: Config) -> tuple[np.ndarray | None, list, tuple | None]:
    """The held-out rows (None without eval.path or eval.mix), the passkey trials, and the prompts whose
    generated answers are scored with their encoder (None without eval.answers_path), read and checked."""
    if not config.eval.held_out and not config.eval.passkey_trials and not config.eval.answers_path:
        raise JlongError("nothing to evaluate: set eval.path or eval.mix, eval.passkey_trials above 0, or "
                         "eval.answers_path")
    answers = answer_trials(config) if config.eval.answers_path else None
    return (held_out_rows(config) if config.eval.held_out else None), passkey_trials(config), answers


def evaluate(config: Config, checkpoint: str, mesh, inputs: tuple | None = None) -> dict:
    """The loss by position on the held-out tokens and the passkey cells, of a checkpoint on `mesh`
    (`inputs`: what `eval_inputs` gave, when the caller checked them first)."""
    held, made, answers = inputs or eval_inputs(config)
    program = TrainProgram(config, mesh)
    preference = config.train.objective == "dpo" and config.eval.path  # held-out preference pairs, TRL's metrics
    # Full fine-tuning's reference before the checkpoint's weights: computing it reads the starting weights.
    reference = held_out_reference(program, say=lambda _: None) if preference and not program.lora else None
    params, step = load_params(program, checkpoint)
    evaluator = Evaluator(program)
    result = {"checkpoint": str(checkpoint), "step": step, "seq_len": config.train.seq_len}
    if preference:
        result["preference"] = held_out_metrics(program, params, reference)
    if held is not None:
        result.update(position_losses(evaluator, params, held))
    result["passkey"] = passkey_accuracy(evaluator, params, made)
    if answers is not None:
        trials, encoder = answers
        result["answers"] = answer_accuracy(program, params, trials, encoder, _stop_ids(config, checkpoint))
    result["not_evaluated"] = not_evaluated(config)
    return result


def _stop_ids(config: Config, checkpoint: str) -> tuple[int, ...]:
    """eval.stop_ids and the end-of-sequence ids of the weights' Hugging Face checkpoint (the one evaluated, or
    the run's model.hf_path)."""
    hf = checkpoint if checkpoint_kind(checkpoint) == "hf" else config.model.hf_path
    return tuple(dict.fromkeys((*config.eval.stop_ids, *(hf_stop_ids(hf) if hf else ()))))


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))

