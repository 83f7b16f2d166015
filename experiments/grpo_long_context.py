"""GRPO at long context, on the CPU mesh: a tiny model fine-tuned to answer
a one-digit code stated in a short user turn, weak at retrieving it from
longer ones, is trained by GRPO with an exact-match reward on its own
generated answers to long prompts, and its held-out generated-answer
accuracy rises there.

Each seed runs, through jlong's API:
1. supervised fine-tuning from random weights on short conversations
   (experiments/chat_finetune.py's: a user turn of SFT_TURN bytes of filler
   with "The code is N." at a random depth, then "What is the code?"; the
   assistant answers "N"; only the answer is trained), as in
   dpo_long_context.py, at train.seq_len 128 on data parallelism;
2. held-out generated answers (`jlong.evaluate` with `eval.answers_path`:
   greedy, stopped at <|im_end|>, exact match) to prompts of
   HELD_OUT_TOKENS tokens, the same prompts for every seed;
3. GRPO (`train.objective: grpo`, `train.init_from` the fine-tuned
   weights, every weight trained): prompts in TRL's conversational format
   of GRPO_TOKENS tokens, completions sampled by jlong's sampler on the
   training mesh (sp 4 x fsdp 2, rows of 1,024 tokens), rewarded by the
   built-in `exact_answer` against the code;
4. the held-out generated answers again.

Reported per prompt length and over all held-out prompts, over the seeds
(the mean, and the lowest and highest seed's): the accuracy before GRPO,
after, and each seed's change; GRPO's reward at its start and end; and a
plot of the reward over GRPO's steps per seed.

    python experiments/grpo_long_context.py [--seeds 0 1 2] [--sft-steps 600] [--grpo-steps 120] [--lr 6e-4]
    python experiments/grpo_long_context.py --rehearse --runs DIR --out DIR   # the whole pipeline, small

Writes experiments/results/grpo-long-context.md, .json and .png (the reward
over GRPO's steps) and runs under runs/grpo-long-context/ (a run that finds
its checkpoints there resumes, or has nothing to do).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import jlong
from chat_finetune import QUESTION, byte_tokenizer, chat_corpus, filler_with_key, prepared
from common import invocation, portable, provenance, provenance_record

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "grpo-long-context"
RESULTS = ROOT / "experiments" / "results"
TINY = ROOT / "configs" / "tiny.yaml"
IM_END = 257  # <|im_end|>: the byte-level ChatML tokenizer's end of a turn, where an answer stops
SFT_TURN = (10, 80)  # bytes of filler in a fine-tuning user turn
HELD_OUT_TOKENS = [96, 192, 384, 768]  # prompt lengths of the held-out prompts, one power-of-two bucket each
GRPO_TOKENS = (300, 500)  # prompt lengths of GRPO's prompts
COMMON = ["model.vocab_size=320", "data.eos_id=null", "checkpoint.every=0"]
SFT = ["data.sampling=documents", "train.seq_len=128", "train.warmup_steps=30", "mesh.data=8", "mesh.fsdp=1",
       "mesh.sp=1"]
LONG_MESH = ["train.seq_len=1024", "mesh.data=1", "mesh.fsdp=2", "mesh.sp=4"]
MAX_NEW = 4  # new tokens of an answer: the digit and <|im_end|>, with room to spare
WEAK = 0.8  # held-out accuracy below which the fine-tuned model is called weak at a length
NAME = "grpo-long-context"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--sft-batch", type=int, default=16, help="the fine-tuning's rows of 128 tokens a step")
    parser.add_argument("--grpo-steps", type=int, default=120)
    parser.add_argument("--generations", type=int, default=4, help="rl.num_generations: completions per prompt")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="rl.prompts_per_step: groups a step")
    parser.add_argument("--lr", type=float, default=6e-4, help="GRPO's learning rate")
    parser.add_argument("--trials", type=int, default=48, help="held-out prompts per length")
    parser.add_argument("--rehearse", action="store_true", help="a few steps of everything: the pipeline, not a result")
    parser.add_argument("--runs", type=Path, default=RUNS, help="where the runs and their files go")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where grpo-long-context.md, .json, .png go")
    args = parser.parse_args()
    if args.rehearse:
        args.sft_steps, args.grpo_steps, args.trials = min(args.sft_steps, 10), min(args.grpo_steps, 3), 2
    began, load = time.perf_counter(), [os.getloadavg()[0]]
    args.runs.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_tokenizer(args.runs / "tokenizer")
    held_out = held_out_prompts(args.runs / "held-out.jsonl", tokenizer, args.trials)
    results, minutes = {}, {}
    for seed in args.seeds:
        started = time.perf_counter()
        results[seed] = run_seed(seed, tokenizer, held_out, args)
        minutes[seed] = (time.perf_counter() - started) / 60
        print(f"seed {seed}: {json.dumps(results[seed]['held_out'])} ({minutes[seed]:.1f} min)", flush=True)
    load.append(os.getloadavg()[0])
    report(results, args, minutes, (time.perf_counter() - began) / 60, load)


def prompt_overhead(tokenizer: Path) -> int:
    """Tokens a conversational prompt adds to its user turn's bytes (ChatML's markers, the generation prompt)."""
    from jlong.data.prompts import PromptEncoder

    return len(PromptEncoder(str(tokenizer), 320).encode([{"role": "user", "content": ""}], "prompt"))


def retrieval_prompt(rng: random.Random, tokens: int, overhead: int, depth: float | None = None) -> dict:
    """A prompt in TRL's conversational format of `tokens` tokens: a user turn of filler with the code at
    `depth` (random when None), then the question; its `answer` the code."""
    text, key = filler_with_key(rng, tokens - overhead - len(QUESTION), depth)
    return {"prompt": [{"role": "user", "content": text + QUESTION}], "answer": key}


def held_out_prompts(path: Path, tokenizer: Path, trials: int) -> Path:
    """`trials` prompts at each of HELD_OUT_TOKENS, the code at evenly spread depths (one file for every seed)."""
    rng, overhead = random.Random(1000), prompt_overhead(tokenizer)
    with path.open("w") as f:
        for tokens in HELD_OUT_TOKENS:
            for trial in range(trials):
                f.write(json.dumps(retrieval_prompt(rng, tokens, overhead, (trial + 0.5) / trials)) + "\n")
    return path


def grpo_prompts(path: Path, tokenizer: Path, seed: int, count: int) -> Path:
    rng, overhead = random.Random(30 + seed), prompt_overhead(tokenizer)
    with path.open("w") as f:
        for _ in range(count):
            f.write(json.dumps(retrieval_prompt(rng, rng.randint(*GRPO_TOKENS), overhead)) + "\n")
    return path


def grpo_rows(completions: int) -> int:
    """train.batch_size that holds a step's completions with their prompts, whole (rows of 1,024 tokens,
    an even count for fsdp 2)."""
    per_row = 1025 // (GRPO_TOKENS[1] + MAX_NEW)
    rows = -(-completions // per_row)
    return rows + rows % 2


def run_seed(seed: int, tokenizer: Path, held_out: Path, args) -> dict:
    """Fine-tunes, scores the held-out answers, trains by GRPO, scores them again."""
    root = args.runs / f"seed-{seed}"
    root.mkdir(parents=True, exist_ok=True)
    chats = prepared(root / "chats.npy", chat_corpus(root / "chats.jsonl", 10 + seed, 8000, *SFT_TURN), tokenizer,
                     chat=True)
    prompts = grpo_prompts(root / "grpo-prompts.jsonl", tokenizer, seed,
                           args.grpo_steps * args.prompts_per_step)

    def run(name: str, *overrides: str) -> list[dict]:
        jlong.train(TINY, [*COMMON, f"train.seed={seed}", f"run_dir={root / name}",
                           f"checkpoint.dir={root / name / 'ckpt'}", *overrides])
        return [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]

    run("sft", *SFT, f"data.path={chats}", f"train.steps={args.sft_steps}", f"train.batch_size={args.sft_batch}")
    before = answers(root / "sft" / "ckpt", tokenizer, held_out)
    records = run("grpo", *LONG_MESH, f"train.batch_size={grpo_rows(args.prompts_per_step * args.generations)}",
                  "data.source=synthetic", "data.path=null", f"data.tokenizer={tokenizer}", "train.objective=grpo",
                  f"train.steps={args.grpo_steps}", f"train.lr={args.lr:g}", "train.warmup_steps=5",
                  f"train.init_from={root / 'sft' / 'ckpt'}", f"rl.prompts={prompts}", "rl.rewards=[exact_answer]",
                  f"rl.num_generations={args.generations}", f"rl.prompts_per_step={args.prompts_per_step}",
                  f"rl.max_new_tokens={MAX_NEW}", "rl.temperature=1.0", f"rl.stop_ids=[{IM_END}]")
    after = answers(root / "grpo" / "ckpt", tokenizer, held_out)
    length = json.loads(chats.with_suffix(".documents.json").read_text())["length"]
    return {"held_out": {"before": before, "after": after},
            "sft_document_tokens": [int(length["min"]), int(length["max"])],
            "reward": [r["reward"] for r in records],
            "grpo_records": [{k: r[k] for k in ("step", "loss", "reward", "reward_std", "frac_reward_zero_std",
                                                "completions/mean_length", "entropy", "grad_norm")} for r in records]}


def answers(checkpoint: Path, tokenizer: Path, held_out: Path) -> dict:
    """`jlong.evaluate`'s generated-answer accuracy by prompt length (each of HELD_OUT_TOKENS is alone in its
    power-of-two bucket), and over all the held-out prompts ("all")."""
    result = jlong.evaluate(TINY, checkpoint, [
        *COMMON, *LONG_MESH, "train.batch_size=8", "data.source=synthetic", "data.path=null", "eval.passkey_trials=0",
        f"eval.answers_path={held_out}", f"eval.tokenizer={tokenizer}", f"eval.stop_ids=[{IM_END}]",
        f"eval.answers_max_new_tokens={MAX_NEW}"])["answers"]
    length = {1 << math.ceil(math.log2(tokens)): tokens for tokens in HELD_OUT_TOKENS}
    accuracy = {str(length[bucket["up_to"]]): bucket["accuracy"] for bucket in result["by_length"]}
    return {**accuracy, "all": result["accuracy"]}


def spread(values: list[float], signed: bool = False) -> str:
    """The mean over the seeds, then the lowest and highest seed's value."""
    form = "+.2f" if signed else ".2f"
    if len(values) == 1:
        return f"{values[0]:{form}}"
    return f"{statistics.mean(values):{form}} [{min(values):{form}}, {max(values):{form}}]"


def report(results: dict, args, minutes: dict, total: float, load: list[float]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = list(results)
    command = invocation(__file__, ["--seeds", *map(str, seeds), f"--sft-steps={args.sft_steps}",
                                    f"--sft-batch={args.sft_batch}", f"--grpo-steps={args.grpo_steps}",
                                    f"--generations={args.generations}",
                                    f"--prompts-per-step={args.prompts_per_step}", f"--lr={args.lr:g}",
                                    f"--trials={args.trials}", *(["--rehearse"] if args.rehearse else []),
                                    *(f"--{name}={portable(str(path))}" for name, path in
                                      (("runs", args.runs), ("out", args.out)) if path not in (RUNS, RESULTS))])
    settings = {"sft_steps": args.sft_steps, "sft_batch": args.sft_batch, "sft_turn_bytes": list(SFT_TURN),
                "grpo_steps": args.grpo_steps, "generations": args.generations,
                "prompts_per_step": args.prompts_per_step, "lr": args.lr, "grpo_prompt_tokens": list(GRPO_TOKENS),
                "held_out_tokens": HELD_OUT_TOKENS, "trials": args.trials, "minutes": minutes, "total_minutes": total,
                "load_average": load}
    (args.out / f"{NAME}.json").write_text(json.dumps(
        {"provenance": provenance_record(command), "settings": settings,
         **{f"seed {seed}": value for seed, value in results.items()}}, indent=1) + "\n")
    plot(results, args.out / f"{NAME}.png")

    columns = [*map(str, HELD_OUT_TOKENS), "all"]

    def accuracy(when: str, column: str) -> list[float]:
        return [results[s]["held_out"][when][column] for s in seeds]

    def change(column: str) -> list[float]:
        return [a - b for a, b in zip(accuracy("after", column), accuracy("before", column))]

    table = ["| held-out prompts of | " + " | ".join(f"{int(c):,} tokens" for c in columns[:-1])
             + f" | all {len(HELD_OUT_TOKENS) * args.trials} |", "|---|" + "---|" * len(columns),
             "| before GRPO (the fine-tuned model) | " + " | ".join(spread(accuracy("before", c)) for c in columns)
             + " |",
             "| after GRPO | " + " | ".join(spread(accuracy("after", c)) for c in columns) + " |",
             "| change (each seed's after - before) | " + " | ".join(spread(change(c), signed=True) for c in columns)
             + " |"]
    grpo = [c for c in columns[:-1] if GRPO_TOKENS[0] <= int(c) <= GRPO_TOKENS[1]]
    weak = [c for c in columns[:-1] if statistics.mean(accuracy("before", c)) < WEAK]
    headline = ("Held-out generated-answer accuracy (greedy, exact match), before GRPO -> after, the mean over "
                f"{len(seeds)} seed(s) [the lowest, the highest seed's]: "
                + "; ".join(f"{int(c):,}-token prompts {spread(accuracy('before', c))} -> "
                            f"{spread(accuracy('after', c))}" for c in columns[:-1])
                + f". The fine-tuned model is weak (below {WEAK:g} before GRPO) at "
                + (", ".join(f"{int(c):,}" for c in weak) or "no length") + " tokens; GRPO trained on prompts of "
                f"{GRPO_TOKENS[0]}-{GRPO_TOKENS[1]} tokens"
                + (f" (the held-out {', '.join(f'{int(c):,}' for c in grpo)} among them)" if grpo else "") + ".")

    def reward(part: slice) -> list[float]:
        return [statistics.mean(results[s]["reward"][part]) for s in seeds]

    window = max(1, min(10, args.grpo_steps // 2))
    records = lambda s: results[s]["grpo_records"]  # noqa: E731
    training = [
        f"| GRPO's rollouts | reward, first {window} steps | reward, last {window} steps | frac_reward_zero_std, "
        f"first {window} | frac_reward_zero_std, last {window} | entropy, first {window} | entropy, last {window} |",
        "|---|---|---|---|---|---|---|",
        f"| mean over the steps | {spread(reward(slice(0, window)))} | {spread(reward(slice(-window, None)))} | "
        + " | ".join(spread([statistics.mean(r[key] for r in records(s)[part]) for s in seeds])
                     for key in ("frac_reward_zero_std", "entropy")
                     for part in (slice(0, window), slice(-window, None))) + " |"]
    sft_tokens = [results[s]["sft_document_tokens"] for s in seeds]
    where = provenance(command, "cpu, 8 virtual devices", how="trained and evaluated on the CPU")
    text = (
        f"# GRPO at long context, on the CPU mesh (measured)\n\n{headline}\n\n{where} {total:.1f} minutes in all "
        f"({', '.join(f'seed {s}: {m:.1f}' for s, m in minutes.items())}), beside other work on the machine "
        f"(the load average over a minute: {load[0]:.1f} at the start, {load[1]:.1f} at the end).\n\n"
        "The tiny model of configs/tiny.yaml (2 layers of 128) with experiments/chat_finetune.py's byte-level "
        "tokenizer and ChatML template. Each seed (train.seed, its own fine-tuning conversations and GRPO "
        f"prompts): {args.sft_steps} steps of supervised fine-tuning from random weights, {args.sft_batch} rows of "
        f"128 tokens a step on data 8, on conversations whose user turn is {SFT_TURN[0]}-{SFT_TURN[1]} bytes of "
        "filler with \"The code is N.\" (one digit, the only one in the turn) at a random depth, then \"What is the "
        f"code?\", the assistant answering \"N\" (conversations of {min(t[0] for t in sft_tokens)}-"
        f"{max(t[1] for t in sft_tokens)} tokens; only the answer trained); then {args.grpo_steps} steps of GRPO "
        f"(train.objective grpo, every weight trained from the fine-tuned ones, a fresh optimizer, lr {args.lr:g}, "
        f"TRL's dapo loss, beta 0) on sp 4 x fsdp 2 in rows of 1,024 tokens: each step {args.prompts_per_step} "
        f"prompts in TRL's conversational format of {GRPO_TOKENS[0]}-{GRPO_TOKENS[1]} tokens (the code at a random "
        f"depth), {args.generations} completions each sampled by jlong's sampler on the training mesh (temperature "
        f"1, up to {MAX_NEW} new tokens, stopped at <|im_end|>), rewarded by the built-in `exact_answer` (1 when "
        "the answer is the code). The reward is the share of a step's completions that answer exactly.\n\n"
        f"Held-out prompts: {args.trials} at each length, the code at evenly spread depths, the same prompts for "
        "every seed and never trained on; each answered greedily by `jlong.evaluate` (eval.answers_path, up to "
        f"{MAX_NEW} new tokens, stopped at <|im_end|>) and scored by exact match, with the fine-tuned weights "
        "(before GRPO) and the GRPO weights (after). The mean over seeds "
        f"{', '.join(map(str, seeds))}, then [the lowest, the highest] seed's:\n\n" + "\n".join(table) + "\n\n"
        "GRPO's own metrics on its rollouts (the mean over the steps, then over the seeds [the lowest, the highest "
        "seed's]; frac_reward_zero_std: the share of groups whose completions all scored alike, which carry no "
        "advantage):\n\n" + "\n".join(training) + "\n\n"
        f"![reward over GRPO's steps]({NAME}.png)\n\n"
        f"`{NAME}.png`: the reward of each step's rollouts per seed (thin) and its mean over {window} steps "
        "(thick). Figures that depend on the machine: all of them (XLA:CPU's arithmetic differs between "
        "processors, and a tiny model's training amplifies it).\n")
    (args.out / f"{NAME}.md").write_text(text)
    print(text)


def plot(results: dict, path: Path) -> None:
    """The reward of GRPO's rollouts over its steps, per seed, with its moving mean."""
    from jlong.plots import pyplot, save

    plt = pyplot()
    figure, ax = plt.subplots(figsize=(7, 4.5))
    for number, (seed, result) in enumerate(results.items()):
        reward = result["reward"]
        steps = range(1, len(reward) + 1)
        window = max(1, min(10, len(reward) // 2))
        mean = [statistics.mean(reward[max(0, i - window + 1):i + 1]) for i in range(len(reward))]
        color = f"C{number}"
        ax.plot(steps, reward, color=color, linewidth=0.6, alpha=0.45)
        ax.plot(steps, mean, color=color, linewidth=2, label=f"seed {seed} (mean over {window} steps)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward (share of exact answers)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"GRPO on prompts of {GRPO_TOKENS[0]}-{GRPO_TOKENS[1]} tokens: the tiny model, CPU mesh")
    ax.legend(fontsize=8)
    save(figure, path)


if __name__ == "__main__":
    sys.exit(main())
