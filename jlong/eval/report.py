"""What `jlong eval` writes and prints: eval.json, a position-loss plot and a passkey heatmap."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

from jlong.eval.evaluate import perplexity
from jlong.plots import pyplot, save

JSON, POSITION_PLOT, PASSKEY_PLOT = "eval.json", "position_loss.png", "passkey.png"


def write(result: dict, out: Path) -> list[Path]:
    """The result's files in `out`, each written whole under a temporary name first."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (JSON + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out / JSON)
    written = [out / JSON]
    if result.get("loss_by_position"):
        written.append(save(_position_figure(result), out / POSITION_PLOT))
    if result.get("passkey"):
        written.append(save(_passkey_figure(result), out / PASSKEY_PLOT))
    return written


def destination(default: Path | None, chosen: Path | None) -> tuple[Path | None, str | None]:
    """Where to write (None: nowhere) and what that does to an earlier evaluation there, said in a line:
    an `--out` that holds one is replaced; the default directory's is kept, this one going to the first
    free of default-2, default-3, ..."""
    if chosen is not None:
        return chosen, f"replaced the earlier evaluation in {chosen}" if (chosen / JSON).exists() else None
    if default is None or not (default / JSON).exists():
        return default, None
    free = next(path for n in itertools.count(2) if not ((path := default.with_name(f"{default.name}-{n}")) / JSON)
                .exists())
    return free, f"kept the earlier evaluation in {default}; this one is in {free}"


def passkey_grid(cells: list[dict]) -> tuple[list[int], list[float], dict]:
    """The passkey cells as (lengths, depths, {(length, depth): accuracy})."""
    accuracy = {(c["length"], c["depth"]): c["accuracy"] for c in cells}
    return sorted({n for n, _ in accuracy}), sorted({d for _, d in accuracy}), accuracy


def summary(result: dict) -> str:
    which = "Hugging Face weights" if result["step"] == "hf" else f"step {result['step']}"
    lines = [f"checkpoint {result['checkpoint']} ({which}) at seq_len {result['seq_len']:,}"]
    preference = result.get("preference")
    if preference:  # a DPO run: its objective's measures first
        lines.append(f"held-out preference pairs ({preference['pairs']:,}), the policy against the run's reference: "
                     f"DPO loss {preference['loss']:.4f}, "
                     + ", ".join(f"{key} {preference[key]:.4f}" for key in preference if "/" in key))
    if "loss" in result:
        what = "next-token loss of the held-out completions (not DPO's objective)" if preference else "held-out loss"
        lines.append(f"{what} {result['loss']:.4f} (perplexity {perplexity(result['loss']):,.2f}) over "
                     f"{result['tokens']:,} tokens; by position:")
        lines += [f"  [{b['start']:>9,}, {b['end']:>9,})  loss {b['loss']:.4f}  ({b['tokens']:,} tokens)"
                  for b in result["loss_by_position"]]
        if "loss_by_source" in result:
            sources = result["loss_by_source"].items()
            lines.append("by source: " + ", ".join(f"{name} {loss:.4f}" for name, loss in sources))
    if result["passkey"]:
        lines.append("passkey accuracy (rows: depth; columns: length):")
        lengths, depths, cell = passkey_grid(result["passkey"])
        lines.append("  depth  " + "".join(f"{n:>10,}" for n in lengths))
        lines += ["  " + f"{d:>5.2f}  " + "".join(f"{cell[n, d]:>10.2f}" for n in lengths) for d in depths]
    if answers := result.get("answers"):
        lines.append(f"generated answers: accuracy {answers['accuracy']:.3f} over {answers['trials']:,} prompts; by "
                     "prompt length: " + ", ".join(f"up to {b['up_to']:,} tokens {b['accuracy']:.3f} ({b['trials']})"
                                                   for b in answers["by_length"]))
    lines += [f"not evaluated: {item['what']} ({item['why']})" for item in result.get("not_evaluated", ())]
    return "\n".join(lines)


def _position_figure(result: dict):
    plt = pyplot()
    buckets = result["loss_by_position"]
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot([max(b["end"], 1) for b in buckets], [b["loss"] for b in buckets], marker="o")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("position in context (bucket end, tokens)")
    axes.set_ylabel("next-token loss")
    axes.set_title(f"loss by position, step {result['step']}, seq_len {result['seq_len']:,}")
    axes.grid(alpha=0.3)
    return figure


def _passkey_figure(result: dict):
    plt = pyplot()
    lengths, depths, cell = passkey_grid(result["passkey"])
    grid = [[cell[n, d] for n in lengths] for d in depths]
    figure, axes = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.6 * len(depths) + 1.8))
    image = axes.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            axes.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    axes.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths])
    axes.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    axes.set_xlabel("context length (tokens)")
    axes.set_ylabel("depth of the key")
    axes.set_title(f"passkey accuracy, step {result['step']}")
    figure.colorbar(image, ax=axes)
    return figure
