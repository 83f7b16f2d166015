"""Context extension that a small model can show on the CPU mesh: it learns
to retrieve a pass key at a short length, is extended through two stages
(longer sequences, a larger RoPE base), and retrieves it farther away; a
control trains the same extra steps at the short length.

The corpus is byte-level documents in the passkey format that `jlong eval`
asks about (a five-digit key stated somewhere in filler text, asked for at
the end): short ones (up to 250 bytes) and long ones (up to 1,000), so that
only a model that attends beyond 256 bytes can answer the long ones.

    python experiments/retrieval_extension.py [--base-steps 3000] [--extra-steps 600]

Writes experiments/results/retrieval-extension/ (results.md, results.json,
passkey.png) and runs under runs/retrieval-extension/. Everything runs
through the Python API (jlong.train, jlong.evaluate) on 8 virtual CPU
devices (fsdp 2 x sp 4); the numbers are measured on the CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import jlong
from common import portable
from jlong.data.prepare import prepare
from jlong.eval.passkey import FILLER, INSTRUCTION, NEEDLE, QUESTION

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results" / "retrieval-extension"
RUNS = ROOT / "runs" / "retrieval-extension"
SENTENCES = [s.strip() + "." for s in FILLER.replace("\n", " ").split(".") if s.strip()]
LENGTHS = [256, 512, 1024]


def document(rng: random.Random, length: int) -> str:
    """A passkey document of about `length` bytes: the key at a random depth of random filler."""
    key = str(rng.randint(10_000, 99_999))
    fixed = len(INSTRUCTION) + len(NEEDLE.format(key=key)) + len(QUESTION) + len(key) + 1
    filler = ""
    while len(filler) < length - fixed:
        filler += rng.choice(SENTENCES) + " "
    filler = filler[: max(length - fixed, 0)]
    at = rng.randint(0, len(filler))
    return INSTRUCTION + filler[:at] + NEEDLE.format(key=key) + filler[at:] + QUESTION + key + "\n"


def corpus(path: Path, seed: int, spans: list[tuple[int, int, int]]) -> Path:
    """JSON Lines of documents: `count` of each (count, shortest, longest) span."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for count, low, high in spans:
            for _ in range(count):
                f.write(json.dumps({"text": document(rng, rng.randint(low, high))}) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-steps", type=int, default=3000)
    parser.add_argument("--extra-steps", type=int, default=600)
    parser.add_argument("--report-only", type=float, metavar="MINUTES",
                        help="rewrite the report from results.json (the run took MINUTES)")
    args = parser.parse_args()
    if args.report_only is not None:
        report(json.loads((RESULTS / "results.json").read_text())["results"], args, args.report_only)
        return
    RUNS.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    short = RUNS / "short.npy"
    prepare(str(short), [str(corpus(RUNS / "short.jsonl", 0, [(6000, 180, 250)]))])
    mixed = RUNS / "mixed.npy"
    prepare(str(mixed), [str(corpus(RUNS / "mixed.jsonl", 1, [(6000, 180, 250), (3000, 180, 1000)]))])
    held_out = RUNS / "held-out.npy"
    prepare(str(held_out), [str(corpus(RUNS / "held-out.jsonl", 2, [(300, 180, 1000), (300, 180, 250)]))])
    tiny = ROOT / "configs" / "tiny.yaml"
    common = ["data.sampling=documents", "train.warmup_steps=50", "checkpoint.every=0"]

    def run(name: str, *overrides: str) -> list[dict]:
        return jlong.train(tiny, [*common, f"run_dir={RUNS / name}", f"checkpoint.dir={RUNS / name / 'ckpt'}",
                                  *overrides])

    base = ["train.seq_len=256", f"data.path={short}", f"train.steps={args.base_steps}"]
    run("base", *base)
    extra = args.extra_steps
    run("extended", f"data.path={mixed}", "data.long_document_weight=2", f"train.steps={extra}",
        f"train.init_from={RUNS / 'base' / 'ckpt'}", "train.seq_len=512",
        f"stages=[{{until_step: {extra // 2}, set: {{train.seq_len: 512, model.rope_theta: 40000.0}}}}, "
        f"{{until_step: {extra}, set: {{train.seq_len: 1024, model.rope_theta: 100000.0}}}}]")
    run("control", f"data.path={mixed}", "data.long_document_weight=2", f"train.steps={extra}",
        f"train.init_from={RUNS / 'base' / 'ckpt'}", "train.seq_len=256")
    evaluation = ["train.seq_len=1024", f"eval.passkey_lengths={LENGTHS}", "eval.passkey_trials=8", "mesh.fsdp=2",
                  f"eval.path={held_out}", "eval.sequences=16",
                  "mesh.sp=4", "train.batch_size=8", "data.source=synthetic", "data.path=null"]
    rope = {"base": 10000.0, "extended": 100000.0, "control": 10000.0}
    results = {name: jlong.evaluate(tiny, RUNS / name / "ckpt", [*evaluation, f"model.rope_theta={rope[name]}"])
               for name in ("base", "extended", "control")}
    minutes = (time.perf_counter() - began) / 60
    report(results, args, minutes)


def _by_length(result: dict) -> dict[int, float]:
    cells: dict[int, list[float]] = {}
    for cell in result["passkey"]:
        cells.setdefault(cell["length"], []).append(cell["accuracy"])
    return {length: sum(values) / len(values) for length, values in sorted(cells.items())}


def report(results: dict, args, minutes: float) -> None:
    accuracy = {name: _by_length(result) for name, result in results.items()}
    for result in results.values():
        result["checkpoint"] = portable(str(result["checkpoint"]))
    (RESULTS / "results.json").write_text(json.dumps({"passkey_by_length": accuracy, "results": results}, indent=1))
    rows = ["| model | " + " | ".join(f"{n:,}" for n in LENGTHS) + " |", "|---|" + "---|" * len(LENGTHS)]
    names = {"base": f"base: {args.base_steps} steps at 256", "extended":
             f"extended: + {args.extra_steps} steps in stages 512 -> 1,024, RoPE base 10,000 -> 100,000",
             "control": f"control: + {args.extra_steps} steps at 256, RoPE base 10,000"}
    for name, cells in accuracy.items():
        rows.append(f"| {names[name]} | " + " | ".join(f"{cells[n]:.2f}" for n in LENGTHS) + " |")
    buckets = [(b["start"], b["end"]) for b in results["base"]["loss_by_position"]]
    loss_rows = ["| positions | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for i, (start, end) in enumerate(buckets):
        losses = [results[name]["loss_by_position"][i]["loss"] for name in names]
        loss_rows.append(f"| [{start:,}, {end:,}) | " + " | ".join(f"{v:.4f}" for v in losses) + " |")
    text = (f"# Context extension that retrieves, on the CPU mesh (measured)\n\n"
            f"Produced by `python experiments/retrieval_extension.py --base-steps {args.base_steps} --extra-steps "
            f"{args.extra_steps}` on 8 virtual CPU devices (fsdp 2 x sp 4), {minutes:.1f} minutes in all. The tiny "
            "model of configs/tiny.yaml (byte-level, 2 layers of 128) on passkey-format documents; passkey "
            "accuracy by prompt length (`jlong eval`, 8 trials at each of 5 depths per length, every digit right):"
            "\n\n" + "\n".join(rows) + "\n\n![passkey accuracy by length](passkey.png)\n\n"
            "Held-out loss by position in the document (16 windows of 1,024 bytes of held-out passkey documents, "
            "base / extended / control):\n\n" + "\n".join(loss_rows) + "\n")
    (RESULTS / "results.md").write_text(text)
    print(text)
    _plot(accuracy, names)


def _plot(accuracy: dict, names: dict) -> None:
    from jlong.plots import pyplot, save

    figure, axes = pyplot().subplots(figsize=(7, 4))
    for name, cells in accuracy.items():
        axes.plot(list(cells), list(cells.values()), marker="o", label=names[name])
    axes.set_xscale("log", base=2)
    axes.set_xticks(LENGTHS, [f"{n:,}" for n in LENGTHS])
    axes.set_xlabel("prompt length (bytes)")
    axes.set_ylabel("passkey accuracy")
    axes.set_ylim(-0.05, 1.05)
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    save(figure, RESULTS / "passkey.png")


if __name__ == "__main__":
    main()
