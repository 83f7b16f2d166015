"""A run in stages: a curriculum of lengths (or of data, layouts, RoPE bases)
in one run that plans, checkpoints and resumes as one.

    stages:
      - {until_step: 200, set: {train.seq_len: 131072}}
      - {until_step: 400, set: {train.seq_len: 524288, model.rope_theta: 4000000}}

Stage k runs the steps after stage k-1's `until_step` up to its own, with
its `set` over the run's config; the last stage ends at train.steps. The
model's weights, the optimizer and its schedule run through every stage: a
stage may set the length and batch, RoPE's base and scaling, the data (path,
sampling, long-document weight, shuffle), the layout on the same devices
(mesh, attention, memory but the optimizer's offload), evaluation and the
learning rate's peak; anything else is refused in one line.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from jlong.config.identity import flatten
from jlong.config.loading import config_from_dict, config_to_dict, read_config
from jlong.config.schema import Config
from jlong.errors import JlongError

# What a stage may set: the length and batch, RoPE, the data, the layout on
# the devices, evaluation, and the learning rate's peak. Nothing that gives
# the weights or the optimizer's state their shapes, nor the run's identity.
_STAGE_SETTINGS = {
    "train.seq_len", "train.batch_size", "train.lr", "model.rope_theta", "model.rope_scaling",
    "data.path", "data.mix", "data.sampling", "data.long_document_weight", "data.shuffle",
}
_STAGE_SECTIONS = ("mesh.", "attention.", "memory.", "eval.")
_NOT_STAGE_SETTINGS = {"memory.optimizer_offload"}  # it lays the optimizer's state out differently


def load_config(path: str | Path | None, overrides: list[str] = (), *, base: dict | None = None,
                check_stages: bool = True) -> Config:
    """Reads a YAML config (or starts from `base`, a config's dict), applies
    `a.b=value` overrides, validates (each stage's config too, unless
    `check_stages` is False: for evaluating one stage's checkpoint)."""
    config = read_config(path, overrides, base=base)
    if config.stages and check_stages:
        stage_runs(config)  # every stage's config checked
    return config


def stage_may_set(key: str) -> bool:
    return key not in _NOT_STAGE_SETTINGS and (key in _STAGE_SETTINGS or key.startswith(_STAGE_SECTIONS))


@dataclass(frozen=True)
class StageRun:
    number: int  # 1-based
    first: int  # its first step
    last: int  # its last step
    config: Config  # the run's config with the stage's settings, without stages


def stage_runs(config: Config) -> list[StageRun]:
    """The run's stages with their configs, checked (one stage, the config itself, without `stages`)."""
    if not config.stages:
        return [StageRun(1, 1, config.train.steps, config)]
    base = config_to_dict(config)
    base["stages"] = []
    known = flatten(base)
    runs, first = [], 1
    for number, stage in enumerate(config.stages, 1):
        where = f"stages[{number - 1}]"
        if stage.until_step < first:
            raise JlongError(f"{where}.until_step ({stage.until_step}) must come after the previous stage's "
                             f"({first - 1}): stages run in order")
        unknown = [key for key in stage.set if key not in known]
        if unknown:
            raise JlongError(f"{where}.set: unknown config key {unknown[0]!r}")
        refused = [key for key in stage.set if not stage_may_set(key)]
        if refused:
            raise JlongError(f"{where}.set: {', '.join(refused)} is the whole run's, not a stage's (a stage may set "
                             f"{', '.join(sorted(_STAGE_SETTINGS))}, and mesh.*, attention.*, memory.* but "
                             "memory.optimizer_offload, eval.*)")
        runs.append(StageRun(number, first, stage.until_step, _stage_config(base, stage.set, where)))
        first = stage.until_step + 1
    if runs[-1].last != config.train.steps:
        raise JlongError(f"the last stage ends at step {runs[-1].last}, train.steps is {config.train.steps}: "
                         f"set stages[{len(runs) - 1}].until_step to {config.train.steps}")
    other = [run for run in runs if run.config.mesh.size != config.mesh.size]
    if other:
        raise JlongError(f"every stage runs on the run's {config.mesh.size} devices; stage {other[0].number}'s mesh "
                         f"has {other[0].config.mesh.size} (a stage may split the same devices another way)")
    return runs


def _stage_config(base: dict, settings: dict, where: str) -> Config:
    try:
        return config_from_dict(_with_settings(base, settings, where))
    except JlongError as err:
        raise JlongError(f"{where}: {err}") from None


def _with_settings(base: dict, settings: dict, where: str) -> dict:
    """A copy of config dict `base` with a stage's dotted settings set."""
    raw = copy.deepcopy(base)
    known = flatten(base)
    for key, value in settings.items():
        if key not in known:
            raise JlongError(f"{where}.set: unknown config key {key!r}")
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node[part]
        node[leaf] = value
    return raw


def stage_at(runs: list[StageRun], step: int) -> StageRun:
    """The stage that runs step `step` (the last one past the end)."""
    return next((run for run in runs if step <= run.last), runs[-1])


def config_at_step(config: Config, step: int, overrides: list[str] = ()) -> Config:
    """The config a run had at `step` (its stage's, in a run in stages) with
    `overrides` applied over it, the stage's settings included: what
    evaluating that step's checkpoint uses. `config` may come from a file
    loaded with the same overrides and `check_stages=False`."""
    base = config_to_dict(config)
    if config.stages:
        number, stage = next(((n, s) for n, s in enumerate(config.stages) if step <= s.until_step),
                             (len(config.stages) - 1, config.stages[-1]))
        base["stages"] = []
        base = _with_settings(base, stage.set, f"stages[{number}]")
    elif not overrides:
        return config
    return read_config(None, list(overrides), base=base)
