"""Context extension that a small model can show on the CPU mesh: it learns
to retrieve a pass key at a short length, is extended through two stages
(longer sequences, a larger RoPE base), and retrieves it farther away; a
control trains the same extra steps at the short length.

The corpus is byte-level documents in the passkey format that `jlong eval`
asks about (a five-digit key stated somewhere in filler text, asked for at
the end): short ones (up to 250 bytes) and long ones (up to 1,000), so that
only a model that attends beyond 256 bytes can answer the long ones.

    python experiments/retrieval_extension.py [--base-steps 10000] [--check-every 1000] [--retrieves 0.9]
                                              [--extra-steps 600] [--seeds 0 1 2]

The base trains until it retrieves: copying the key's digits is learned as a
sudden transition at a seed-dependent step, so the base trains at a constant
learning rate (after warmup; a rate that decays before the transition leaves
it half-formed) in rounds of `--check-every` steps, its run resumed each
round, until its passkey accuracy at 256 bytes reaches `--retrieves` or it has
trained `--base-steps`. The check draws its keys with another seed than the
final evaluation's. The results show each seed's checks.

Repeats the whole recipe for each seed (`train.seed`, which also draws that
seed's training documents) and reports the mean and the spread. Writes
experiments/results/retrieval-extension/ (results.md, results.json,
passkey.png) and runs under runs/retrieval-extension/seed-N/. Everything runs
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
from common import invocation, portable, provenance, provenance_record
from jlong.checkpoint import saved_steps
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
    parser.add_argument("--base-steps", type=int, default=10000, help="the most steps the base trains")
    parser.add_argument("--check-every", type=int, default=1000,
                        help="steps between the base's passkey checks at 256 bytes")
    parser.add_argument("--retrieves", type=float, default=0.9,
                        help="passkey accuracy at 256 bytes (every digit right) at which the base stops")
    parser.add_argument("--extra-steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="train.seed of each repetition; its training documents are drawn with it too")
    parser.add_argument("--report-only", type=float, metavar="MINUTES",
                        help="rewrite the report from results.json (the run took MINUTES)")
    args = parser.parse_args()
    if args.report_only is not None:
        report(json.loads((RESULTS / "results.json").read_text())["seeds"], args, args.report_only)
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    RUNS.mkdir(parents=True, exist_ok=True)
    held_out = RUNS / "held-out.npy"  # one evaluation set for every seed
    if not held_out.exists():
        prepare(str(held_out), [str(corpus(RUNS / "held-out.jsonl", 2, [(300, 180, 1000), (300, 180, 250)]))])
    seeds = {str(seed): one_seed(seed, held_out, args) for seed in args.seeds}
    report(seeds, args, (time.perf_counter() - began) / 60)


def one_seed(seed: int, held_out: Path, args) -> dict:
    """Base, extended and control runs of one seed, each evaluated: `jlong.evaluate`'s result by model."""
    runs = RUNS / f"seed-{seed}"
    runs.mkdir(parents=True, exist_ok=True)
    short, mixed = runs / "short.npy", runs / "mixed.npy"  # seed 0's are the documents of the first results
    if not short.exists():
        prepare(str(short), [str(corpus(runs / "short.jsonl", 10 * seed, [(6000, 180, 250)]))])
    if not mixed.exists():
        prepare(str(mixed), [str(corpus(runs / "mixed.jsonl", 10 * seed + 1,
                                        [(6000, 180, 250), (3000, 180, 1000)]))])
    tiny = ROOT / "configs" / "tiny.yaml"
    common = ["data.sampling=documents", "train.warmup_steps=50", "checkpoint.every=0", f"train.seed={seed}"]

    def run(name: str, *overrides: str) -> list[dict]:
        return jlong.train(tiny, [*common, f"run_dir={runs / name}", f"checkpoint.dir={runs / name / 'ckpt'}",
                                  *overrides])

    checks = {}
    trained = (saved_steps(runs / "base" / "ckpt") or [0])[-1]  # a run found from before continues from there
    for steps in range(max(args.check_every, trained), args.base_steps + 1, args.check_every):
        run("base", "train.seq_len=256", f"data.path={short}", f"train.steps={steps}", "train.min_lr_ratio=1.0")
        checks[steps] = _mean(jlong.evaluate(tiny, runs / "base" / "ckpt", [
            "train.seq_len=256", "eval.passkey_lengths=[256]", "eval.passkey_trials=8", f"train.seed={1000 + seed}",
            "data.source=synthetic", "data.path=null"])["passkey"])
        print(f"seed {seed}, base at step {steps}: passkey accuracy at 256 {checks[steps]['accuracy']:.2f}", flush=True)
        if checks[steps]["accuracy"] >= args.retrieves:
            break
    extra = args.extra_steps
    run("extended", f"data.path={mixed}", "data.long_document_weight=2", f"train.steps={extra}",
        f"train.init_from={runs / 'base' / 'ckpt'}", "train.seq_len=512",
        f"stages=[{{until_step: {extra // 2}, set: {{train.seq_len: 512, model.rope_theta: 40000.0}}}}, "
        f"{{until_step: {extra}, set: {{train.seq_len: 1024, model.rope_theta: 100000.0}}}}]")
    run("control", f"data.path={mixed}", "data.long_document_weight=2", f"train.steps={extra}",
        f"train.init_from={runs / 'base' / 'ckpt'}", "train.seq_len=256")
    evaluation = ["train.seq_len=1024", f"eval.passkey_lengths={LENGTHS}", "eval.passkey_trials=8", "mesh.fsdp=2",
                  f"eval.path={held_out}", "eval.sequences=16",
                  "mesh.sp=4", "train.batch_size=8", "data.source=synthetic", "data.path=null"]
    rope = {"base": 10000.0, "extended": 100000.0, "control": 10000.0}
    results = {name: jlong.evaluate(tiny, runs / name / "ckpt", [*evaluation, f"model.rope_theta={rope[name]}"])
               for name in ("base", "extended", "control")}
    for result in results.values():
        result["checkpoint"] = portable(str(result["checkpoint"]))
    results["base"]["passkey_while_training"] = checks
    return results


def _mean(cells: list[dict]) -> dict[str, float]:
    """Passkey accuracy and digit accuracy over a length's cells."""
    return {key: sum(cell[key] for cell in cells) / len(cells) for key in ("accuracy", "digit_accuracy")}


def _by_length(result: dict) -> dict[int, float]:
    """Passkey accuracy (every digit right) at each prompt length, over its depths."""
    cells: dict[int, list[dict]] = {}
    for cell in result["passkey"]:
        cells.setdefault(cell["length"], []).append(cell)
    return {length: _mean(by_depth)["accuracy"] for length, by_depth in sorted(cells.items())}


def _spread(values: list[float], digits: int) -> str:
    """Mean (min-max) over the seeds."""
    return f"{sum(values) / len(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def report(seeds: dict, args, minutes: float) -> None:
    accuracy = {seed: {name: _by_length(result) for name, result in results.items()} for seed, results in seeds.items()}
    command = invocation(__file__, [f"--base-steps={args.base_steps}", f"--check-every={args.check_every}",
                                    f"--retrieves={args.retrieves:g}", f"--extra-steps={args.extra_steps}",
                                    "--seeds", *map(str, seeds)])
    (RESULTS / "results.json").write_text(json.dumps({"passkey_by_length": accuracy, "seeds": seeds,
                                                      "provenance": provenance_record(command)}, indent=1))
    names = {"base": f"base: at 256 until it retrieves ({args.retrieves:g}; at most {args.base_steps:,} steps)",
             "extended": f"extended: + {args.extra_steps} steps in stages 512 -> 1,024, RoPE base 10,000 -> 100,000",
             "control": f"control: + {args.extra_steps} steps at 256, RoPE base 10,000"}
    rows = ["| model | " + " | ".join(f"{n:,}" for n in LENGTHS) + " |", "|---|" + "---|" * len(LENGTHS)]
    for name in names:
        cells = [_spread([accuracy[seed][name][n] for seed in seeds], 2) for n in LENGTHS]
        rows.append(f"| {names[name]} | " + " | ".join(cells) + " |")
    per_seed = ["| seed | model | " + " | ".join(f"{n:,}" for n in LENGTHS) + " |", "|---|---|" + "---|" * len(LENGTHS)]
    for seed in seeds:
        for name in names:
            per_seed.append(f"| {seed} | {name} | " + " | ".join(f"{accuracy[seed][name][n]:.2f}" for n in LENGTHS)
                            + " |")
    checks = sorted({int(step) for results in seeds.values() for step in results["base"]["passkey_while_training"]})
    while_training = ["| seed | " + " | ".join(f"step {step:,}" for step in checks) + " |",
                      "|---|" + "---|" * len(checks)]
    for seed, results in seeds.items():
        by_step = {int(step): cell for step, cell in results["base"]["passkey_while_training"].items()}
        while_training.append(f"| {seed} | " + " | ".join(
            f"{by_step[step]['accuracy']:.2f} ({by_step[step]['digit_accuracy']:.2f})" if step in by_step else ""
            for step in checks) + " |")
    first = next(iter(seeds.values()))
    buckets = [(b["start"], b["end"]) for b in first["base"]["loss_by_position"]]
    loss_rows = ["| positions | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for i, (start, end) in enumerate(buckets):
        losses = [_spread([seeds[seed][name]["loss_by_position"][i]["loss"] for seed in seeds], 3) for name in names]
        loss_rows.append(f"| [{start:,}, {end:,}) | " + " | ".join(losses) + " |")
    text = (f"# Context extension that retrieves, on the CPU mesh (measured)\n\n"
            f"{provenance(command, 'cpu, 8 virtual devices: fsdp 2 x sp 4').replace('compiled memory analysis, nothing allocated', 'trained and evaluated on the CPU')} "
            f"{minutes:.1f} minutes in all, {len(seeds)} seeds (`train.seed`, which also draws each seed's training "
            "documents; one held-out set). The tiny model of configs/tiny.yaml (byte-level, 2 layers of 128) on "
            "passkey-format documents; passkey accuracy by prompt length (`jlong eval`, 8 trials at each of 5 "
            "depths per length, every digit right), the mean over seeds and (min-max):"
            "\n\n" + "\n".join(rows) + "\n\n![passkey accuracy by length](passkey.png)\n\n"
            "The base's passkey accuracy at 256 bytes at each check while it trained (keys of another seed), "
            "every digit right (and digit by digit):\n\n" + "\n".join(while_training) + "\n\n"
            "Held-out loss by position in the document (16 windows of 1,024 bytes of held-out passkey documents), "
            "mean (min-max) over seeds:\n\n" + "\n".join(loss_rows) + "\n\nEach seed's passkey accuracy:\n\n"
            + "\n".join(per_seed) + "\n\nFigures that depend on the machine: all of them (XLA:CPU's arithmetic "
            "differs between processors, and a tiny model's training amplifies it); the test "
            "tests/test_retrieval_extension.py guards the conclusion on loss by position, which holds with margin.\n")
    (RESULTS / "results.md").write_text(text)
    print(text)
    _plot(accuracy, names)


def _plot(accuracy: dict, names: dict) -> None:
    from jlong.plots import pyplot, save

    figure, axes = pyplot().subplots(figsize=(7, 4))
    for name in names:
        by_seed = [[accuracy[seed][name][n] for n in LENGTHS] for seed in accuracy]
        mean = [sum(column) / len(column) for column in zip(*by_seed)]
        line, = axes.plot(LENGTHS, mean, marker="o", label=names[name])
        axes.fill_between(LENGTHS, [min(c) for c in zip(*by_seed)], [max(c) for c in zip(*by_seed)],
                          color=line.get_color(), alpha=0.15)
    axes.set_xscale("log", base=2)
    axes.set_xticks(LENGTHS, [f"{n:,}" for n in LENGTHS])
    axes.set_xlabel("prompt length (bytes)")
    axes.set_ylabel("passkey accuracy (mean, min-max over seeds)")
    axes.set_ylim(-0.05, 1.05)
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    save(figure, RESULTS / "passkey.png")


if __name__ == "__main__":
    main()
