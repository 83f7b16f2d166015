"""What makes a run the run it is: the settings that change its mathematics.

A run continues (from its run directory or its checkpoints) only under the
same mathematics: the model, the data, the sequence length and batch, the
optimizer, the seed and dtypes. It may change how that mathematics is laid
out on devices (the mesh, attention's kernel and stages, the kernels, the memory knobs
other than the optimizer's offload), how long it trains, how often it saves,
what it measures and where its directories are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jlong.config.validation import with_family

# Settings outside the layout sections that a continued run may change.
_FREE_SETTINGS = {
    "train.steps", "train.profile_start", "train.profile_steps", "train.gpu_memory_fraction",
    "train.check_host_memory", "train.eval_every", "train.log_to",
    "checkpoint.every", "checkpoint.keep", "checkpoint.dir", "run_dir",
}
_FREE_SECTIONS = ("eval.",)
LAYOUT_SECTIONS = ("mesh.", "attention.", "memory.", "kernels.")
# In a layout section, but it changes the optimizer state's layout and the gradients' dtype.
_NOT_LAYOUT = {"memory.optimizer_offload"}


def resumable(key: str) -> bool:
    """Whether a continued run may change the dotted setting `key`."""
    if key in _NOT_LAYOUT:
        return False
    return key in _FREE_SETTINGS or key.startswith(_FREE_SECTIONS + LAYOUT_SECTIONS)


def flatten(tree: dict, prefix: str = "") -> dict:
    """A config's dict as {section.key: value}; a value that is a table (RoPE scaling, remat runs) stays one."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and not prefix:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@dataclass
class Changes:
    """How a config differs from the one a run was written with."""

    before: dict
    now: dict
    refused: list[str] = field(default_factory=list)  # settings that change the mathematics
    relaid: list[str] = field(default_factory=list)  # layout settings, which may change

    def named(self, keys: list[str], most: int = 4) -> str:
        """'train.lr 0.001 -> 0.01, train.seq_len 64 -> 128' (the first `most`, then a count)."""
        shown = [f"{k} {self.before.get(k)} -> {self.now.get(k)}" for k in keys[:most]]
        more = f" and {len(keys) - most} more" if len(keys) > most else ""
        return ", ".join(shown) + more


def changes(before: dict, now: dict) -> Changes:
    """The settings of config dict `now` that differ from `before` (both as `config_to_dict` writes them)."""
    if isinstance(before.get("model"), dict) and "family" not in before["model"]:  # written before families had names
        before = {**before, "model": with_family(before["model"])}
    flat_before, flat_now = flatten(before), flatten(now)
    # A setting `before` lacks came after the run was written: a resume takes it as configured.
    changed = sorted(k for k in flat_before if flat_before[k] != flat_now.get(k))
    return Changes(
        flat_before, flat_now,
        refused=[k for k in changed if not resumable(k)],
        relaid=[k for k in changed if k.startswith(LAYOUT_SECTIONS) and resumable(k)],
    )
