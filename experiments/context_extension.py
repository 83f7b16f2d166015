"""Context extension on the CPU mesh, end to end with the `jlong` command line.

1. `jlong prepare` two corpora of real text (Python's standard library, bytes):
   files named a-m to train on, files named n-z held out for evaluation.
2. Train the README's tiny model at 256 tokens (configs/tiny.yaml's model).
3. Convert that checkpoint to Hugging Face and evaluate it at 8x the length,
   2,048 tokens, with rope_theta raised from 10,000 to 100,000 ("before").
4. Continue training it at 2,048 tokens with that rope_theta on whole
   documents (`data.sampling: documents`, long ones up-sampled 2x).
5. Evaluate again ("after"), and compare.

    python experiments/context_extension.py [--work runs/context-extension] [--steps 200 100]

Writes experiments/results/context-extension/{before,after}/ (eval.json,
position_loss.png, passkey.png), compare.png and context-extension.md.
Everything runs on 8 virtual CPU devices; the numbers are what this small
model does, reported as they fall.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from common import RESULTS, ROOT, markdown_table

OUT = RESULTS / "context-extension"
SHORT, LONG, THETA = 256, 2048, 100_000.0


def jlong(*args) -> None:
    command = [sys.executable, "-m", "jlong", *map(str, args)]
    print("$ jlong " + " ".join(map(str, args)), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default="runs/context-extension", help="where the runs go")
    parser.add_argument("--steps", nargs=2, type=int, default=[200, 100], metavar=("SHORT", "LONG"))
    args = parser.parse_args()
    work = (ROOT / args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    stdlib = sysconfig.get_path("stdlib")
    began = time.perf_counter()

    jlong("prepare", work / "train.npy", stdlib, "--glob", "[a-m]*.py")
    jlong("prepare", work / "held-out.npy", stdlib, "--glob", "[n-z]*.py", "--max-tokens", 2_000_000)
    common = ["configs/tiny.yaml", f"data.path={work / 'train.npy'}", f"eval.path={work / 'held-out.npy'}",
              "eval.sequences=32", "eval.passkey_trials=4"]
    short_steps, long_steps = args.steps
    jlong("train", *common, f"train.steps={short_steps}", f"run_dir={work / 'short'}",
          f"checkpoint.dir={work / 'short' / 'checkpoints'}")
    jlong("convert", work / "short" / "checkpoints", work / "short-hf")

    long = [*common, f"model.hf_path={work / 'short-hf'}", f"model.rope_theta={THETA}", f"train.seq_len={LONG}",
            "attention.block_size=512"]
    jlong("eval", *long, "--checkpoint", work / "short-hf", "--out", OUT / "before")
    jlong("train", *long, f"train.steps={long_steps}", "train.warmup_steps=5", "train.lr=1e-3",
          "data.sampling=documents", "data.long_document_weight=2",
          f"run_dir={work / 'long'}", f"checkpoint.dir={work / 'long' / 'checkpoints'}")
    jlong("eval", *long, "--checkpoint", work / "long" / "checkpoints", "--out", OUT / "after")

    before, after = (json.loads((OUT / stage / "eval.json").read_text()) for stage in ("before", "after"))
    _plot(before, after, OUT / "compare.png")
    (OUT / "context-extension.md").write_text(_report(before, after, args, time.perf_counter() - began))
    print((OUT / "context-extension.md").read_text())
    return 0


def _plot(before: dict, after: dict, path: Path) -> None:
    from jlong.plots import pyplot, save

    figure, axes = pyplot().subplots(figsize=(7, 4))
    for result, label in ((before, "before: trained at 256, evaluated at 2,048"),
                          (after, "after: continued at 2,048 on documents")):
        buckets = result["loss_by_position"]
        axes.plot([max(b["end"], 1) for b in buckets], [b["loss"] for b in buckets], marker="o", label=label)
    axes.axvline(SHORT, color="gray", linestyle=":", label="the first training length (256)")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("position in document (bucket end, bytes)")
    axes.set_ylabel("held-out next-byte loss")
    axes.set_title("context extension of the tiny model, 8 CPU devices")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    save(figure, path)


def _report(before: dict, after: dict, args, seconds: float) -> str:
    rows = [[f"[{b['start']:,}, {b['end']:,})", f"{b['tokens']:,}", f"{b['loss']:.4f}", f"{a['loss']:.4f}"]
            for b, a in zip(before["loss_by_position"], after["loss_by_position"], strict=True)]
    from jlong.eval.report import passkey_grid

    lengths, depths, cells = passkey_grid(after["passkey"])
    first = passkey_grid(before["passkey"])[2]
    passkey_rows = [[f"{d:.0%}", *(f"{first[n, d]:.2f} -> {cells[n, d]:.2f}" for n in lengths)] for d in depths]
    return "\n".join([
        "# Context extension on the CPU mesh (measured)",
        "",
        f"Produced by `python experiments/context_extension.py --steps {args.steps[0]} {args.steps[1]}` on 8 "
        f"virtual CPU devices (fsdp=2 x sp=4), {seconds / 60:.1f} minutes in all. The tiny model of "
        "configs/tiny.yaml (byte-level, 2 layers of 128) trained on Python standard-library files named a-m at "
        f"{SHORT} tokens, then continued at {LONG} with rope_theta {THETA:,.0f} (from 10,000) on whole "
        "documents, long ones drawn twice as often. Evaluated on files named n-z (held out).",
        "",
        f"Held-out loss: {before['loss']:.4f} before, {after['loss']:.4f} after, over {after['tokens']:,} tokens. "
        f"The continued model has also trained {args.steps[1]} more steps than the one before it: the comparison "
        "does not separate the longer context and the raised rope_theta from the extra training.",
        "",
        "## Loss by position in the document",
        "",
        markdown_table(["positions", "tokens", "before", "after"], rows),
        "",
        "![loss by position](compare.png)",
        "",
        f"## Passkey accuracy, before -> after ({after['passkey'][0]['trials']} trials per cell)",
        "",
        markdown_table(["depth", *(f"{n:,}" for n in lengths)], passkey_rows),
        "",
        "Heatmaps: [before](before/passkey.png), [after](after/passkey.png).",
        "",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
