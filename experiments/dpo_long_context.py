"""DPO at long context, on the CPU mesh: a tiny model fine-tuned on short
conversations learns, by DPO on long ones, to prefer the answer that is
faithful to a fact stated deep in the prompt over one that contradicts it.

Each seed runs, through jlong:
1. supervised fine-tuning from random weights on short conversations
   (experiments/chat_finetune.py's: a user turn of SFT_TURN bytes of filler
   with "The code is N." at a random depth, then "What is the code?"; the
   assistant answers "N"; `prepare(chat=True)` masks all but the answer),
   at train.seq_len 128 on data parallelism. The model learns to retrieve
   the code there, and less well from prompts several times longer;
2. DPO (`train.objective: dpo`, every weight trained, `train.init_from` the
   fine-tuned weights, whose log-probabilities of every pair, computed once
   before step 1, are the reference) on preference pairs in TRL's
   conversational format (`prepare(preference=True)`): the prompt a user
   turn of DPO_TURN bytes with the code at a random depth, `chosen` the
   assistant answering the code, `rejected` it answering another digit (an
   answer the prompt contradicts). A pair (two documents of 290-380 tokens)
   fills a row of 768 tokens on sp 4 x fsdp 2, so each document crosses
   the sequence shards;
3. held-out pairs (the user turn HELD_OUT_TURN bytes, the code at 10%, 50%
   or 90% of it) scored by the run's own forward pass
   (`document_logps_and_routing`: the sums of each completion's
   log-probabilities that the objective takes) under the fine-tuned
   weights (the reference) and the DPO weights (the policy).

Reported per depth and over all held-out pairs, over the seeds (the mean,
and the lowest and highest seed's): first the share of pairs that each
model itself gives the faithful answer the higher log-probability (chance:
0.5), before DPO (the fine-tuned model) and after; then TRL's
`rewards/accuracies` after DPO (the share of pairs whose implicit reward
beta (log pi - log ref) is higher for the chosen completion than for the
rejected one: 0 before DPO by construction, where the policy is the
reference, every reward is 0 and a tie does not count) and
`rewards/margins`.

    python experiments/dpo_long_context.py [--seeds 0 1 2] [--sft-steps 600] [--dpo-steps 100]

Writes experiments/results/dpo-long-context.md (and .json) and runs under
runs/dpo-long-context/ (a run that finds its checkpoints there resumes, or
has nothing to do).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import jlong
from chat_finetune import QUESTION, byte_tokenizer, chat_corpus, filler_with_key, prepared
from common import invocation, portable, provenance

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "dpo-long-context"
RESULTS = ROOT / "experiments" / "results"
TINY = ROOT / "configs" / "tiny.yaml"
DEPTHS = [0.1, 0.5, 0.9]
SFT_TURN = (10, 80)  # bytes of filler in a fine-tuning user turn
DPO_TURN = (250, 340)  # in a DPO prompt: a pair's two documents fit a row of 768 tokens
HELD_OUT_TURN = 300
BETA = 0.1
END = 258  # <|endoftext|>: the end-of-document id `prepare` takes for chat_finetune's ChatML tokenizer
COMMON = ["model.vocab_size=320", "data.eos_id=null", "checkpoint.every=0"]
SFT = ["data.sampling=documents", "train.seq_len=128", "train.warmup_steps=30", "mesh.data=8", "mesh.fsdp=1",
       "mesh.sp=1"]
DPO = ["train.objective=dpo", f"train.dpo_beta={BETA}", "train.seq_len=768", "train.lr=1e-3",
       "train.warmup_steps=10", "mesh.data=1", "mesh.fsdp=2", "mesh.sp=4"]
TRL_METRICS = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "logps/chosen",
               "logps/rejected")


def preference_record(rng: random.Random, length: int, depth: float | None = None) -> dict:
    """A record in TRL's conversational preference format: the prompt a user turn of about `length` bytes
    with the code at `depth` (random when None); chosen the code, rejected another digit."""
    text, key = filler_with_key(rng, length, depth)
    wrong = str(rng.choice([digit for digit in range(10) if str(digit) != key]))
    return {"prompt": [{"role": "user", "content": text + QUESTION}],
            "chosen": [{"role": "assistant", "content": key}],
            "rejected": [{"role": "assistant", "content": wrong}]}


def preference_corpus(path: Path, seed: int, count: int, low: int, high: int,
                      depths: list[float | None] = (None,)) -> Path:
    """`count` records for each of `depths`, in that order, the user turn `low`-`high` bytes."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for depth in depths:
            for _ in range(count):
                f.write(json.dumps(preference_record(rng, rng.randint(low, high), depth)) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--dpo-steps", type=int, default=100)
    parser.add_argument("--pairs", type=int, default=800, help="DPO training pairs per seed (one a row: 8 a step)")
    parser.add_argument("--trials", type=int, default=64, help="held-out pairs per depth")
    parser.add_argument("--runs", type=Path, default=RUNS, help="where the runs and token files go")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where dpo-long-context.md and .json go")
    args = parser.parse_args()
    began, load = time.perf_counter(), [os.getloadavg()[0]]
    args.runs.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_tokenizer(args.runs / "tokenizer")
    held_out = prepared(args.runs / "held-out.npy",
                        preference_corpus(args.runs / "held-out.jsonl", 1000, args.trials, HELD_OUT_TURN,
                                          HELD_OUT_TURN, DEPTHS), tokenizer, preference=True)
    results, minutes = {}, {}
    for seed in args.seeds:
        started = time.perf_counter()
        results[seed] = run_seed(seed, tokenizer, held_out, args)
        minutes[seed] = (time.perf_counter() - started) / 60
        print(f"seed {seed}: {json.dumps(results[seed])} ({minutes[seed]:.1f} min)", flush=True)
    load.append(os.getloadavg()[0])
    report(results, args, minutes, (time.perf_counter() - began) / 60, load)


def run_seed(seed: int, tokenizer: Path, held_out: Path, args) -> dict:
    """Fine-tunes, trains by DPO, then scores the held-out pairs under both weights."""
    root = args.runs / f"seed-{seed}"
    root.mkdir(parents=True, exist_ok=True)
    chats = prepared(root / "chats.npy", chat_corpus(root / "chats.jsonl", 10 + seed, 8000, *SFT_TURN), tokenizer,
                     chat=True)
    pairs = prepared(root / "pairs.npy", preference_corpus(root / "pairs.jsonl", 20 + seed, args.pairs, *DPO_TURN),
                     tokenizer, preference=True)

    def run(name: str, *overrides: str) -> None:
        jlong.train(TINY, [*COMMON, f"train.seed={seed}", f"run_dir={root / name}",
                           f"checkpoint.dir={root / name / 'ckpt'}", *overrides])

    run("sft", *SFT, f"data.path={chats}", f"train.steps={args.sft_steps}")
    run("dpo", *DPO, f"data.path={pairs}", f"train.steps={args.dpo_steps}", f"train.init_from={root / 'sft' / 'ckpt'}")
    scorer = HeldOut(held_out)
    reference, policy = scorer.logps(root / "sft" / "ckpt"), scorer.logps(root / "dpo" / "ckpt")
    by_depth = {}
    for number, depth in enumerate(DEPTHS):
        rows = slice(number * args.trials, (number + 1) * args.trials)
        by_depth[depth] = {"before": pair_scores(reference[rows], reference[rows]),
                           "after": pair_scores(policy[rows], reference[rows])}
    by_depth["all"] = {"before": pair_scores(reference, reference), "after": pair_scores(policy, reference)}
    records = [json.loads(line) for line in (root / "dpo" / "metrics.jsonl").read_text().splitlines()]
    files = {"sft": chats, "dpo": pairs, "held_out": held_out}
    return {"held_out": by_depth, "document_tokens": {name: document_tokens(path) for name, path in files.items()},
            "dpo_first_step": {k: records[0][k] for k in ("loss", *TRL_METRICS)},
            "dpo_last_steps": {k: statistics.mean(r[k] for r in records[-10:]) for k in ("loss", *TRL_METRICS)}}


def document_tokens(path: Path) -> list[int]:
    """[shortest, longest] document of a prepared file, in tokens (its end id included)."""
    length = json.loads(path.with_suffix(".documents.json").read_text())["length"]
    return [int(length["min"]), int(length["max"])]


class HeldOut:
    """Held-out preference pairs scored through the run's own forward pass: each pair's (chosen, rejected)
    sum of completion log-probabilities (what the objective sums), in rows as data.sampling=pairs lays
    them out, on the DPO run's mesh; one program, one compiled forward for every checkpoint."""

    def __init__(self, path: Path):
        import jax

        from jlong.config import load_config
        from jlong.data.sources import Batches
        from jlong.jax_startup import start_backends
        from jlong.parallel.placement import make_mesh
        from jlong.program.train_program import TrainProgram

        start_backends(cpu_devices=8)
        self.config = load_config(TINY, [*COMMON, *DPO, f"data.path={path}", f"data.eos_id={END}",
                                         "checkpoint.dir=null", "run_dir=null"])
        self.program = TrainProgram(self.config, make_mesh(self.config.mesh))
        self.source = Batches.from_config(self.config).source
        count = self.config.attention.max_documents
        self.forward = jax.jit(lambda params, batch: self.program.bind(params).document_logps_and_routing(
            batch, count)[0])

    def logps(self, checkpoint: Path) -> np.ndarray:
        """[pairs, 2] under the newest weights in `checkpoint`, in the file's order."""
        from jlong.data.sources import document_structure
        from jlong.eval.evaluate import load_params

        params, _ = load_params(self.program, str(checkpoint))
        source, B = self.source, self.config.train.batch_size
        rows = source.rows_per_epoch(0)
        logps = np.full((len(source.starts), 2), np.nan, np.float32)
        for first in range(0, rows, B):
            indices = [min(i, rows - 1) for i in range(first, first + B)]  # the last batch repeats its last row
            sequences = np.stack([source.row(i) for i in indices])
            slots = np.stack([source.slot_row(i) for i in indices])[:, 1:]
            batch = {"inputs": sequences[:, :-1], "targets": sequences[:, 1:], "loss_mask": slots >= 0,
                     "pair_documents": slots, **document_structure(sequences[:, :-1], END)}
            values = np.asarray(self.forward(params, self.program.place_batch(batch)))
            for b, i in enumerate(indices):
                pairs = source.pairs_of(i)
                logps[pairs] = values[b, :2 * len(pairs)].reshape(-1, 2)
        if np.isnan(logps).any():
            raise RuntimeError("a held-out pair fits no row")
        return logps


def pair_scores(policy: np.ndarray, reference: np.ndarray) -> dict:
    """[pairs, 2] (chosen, rejected) sums -> TRL's reward accuracy and margin of the policy against the
    reference, and how often the policy itself puts the chosen answer first."""
    rewards = BETA * (policy - reference)
    return {"rewards/accuracies": float(np.mean(rewards[:, 0] > rewards[:, 1])),
            "rewards/margins": float(np.mean(rewards[:, 0] - rewards[:, 1])),
            "prefers_chosen": float(np.mean(policy[:, 0] > policy[:, 1]))}


def spread(values: list[float]) -> str:
    """The mean over the seeds, then the lowest and highest seed's value."""
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def report(results: dict, args, minutes: dict, total: float, load: list[float]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dpo-long-context.json").write_text(json.dumps(
        {f"seed {seed}": value for seed, value in results.items()}, indent=1) + "\n")
    seeds = list(results)
    tokens = {}
    for name in ("sft", "dpo", "held_out"):
        low, high = (f([results[s]["document_tokens"][name][i] for s in seeds]) for f, i in ((min, 0), (max, 1)))
        tokens[name] = f"{low}" if low == high else f"{low}-{high}"

    columns = [*DEPTHS, "all"]

    def held_out(when: str, key: str, column) -> list[float]:
        return [results[s]["held_out"][column][when][key] for s in seeds]

    rows = [("the fine-tuned model (before DPO) prefers the faithful answer", "before", "prefers_chosen"),
            ("the DPO model prefers the faithful answer", "after", "prefers_chosen"),
            ("rewards/accuracies after DPO", "after", "rewards/accuracies"),
            ("rewards/margins after DPO", "after", "rewards/margins")]
    table = ["| held-out pairs, the code at | " + " | ".join(f"{d:.0%} of the prompt" for d in DEPTHS)
             + f" | all {len(DEPTHS) * args.trials} pairs |", "|---|" + "---|" * len(columns),
             *(f"| {label} | " + " | ".join(spread(held_out(when, key, c)) for c in columns) + " |"
               for label, when, key in rows)]
    headline = (f"The preference for the faithful answer on all {len(DEPTHS) * args.trials} held-out pairs: "
                f"{spread(held_out('before', 'prefers_chosen', 'all'))} before DPO (the fine-tuned model), "
                f"{spread(held_out('after', 'prefers_chosen', 'all'))} after.")
    training = ["| DPO training batches | loss | " + " | ".join(TRL_METRICS) + " |", "|---|" + "---|" * 7]
    for label, key in (("step 1", "dpo_first_step"), ("last 10 steps", "dpo_last_steps")):
        training.append(f"| {label} | " + " | ".join(spread([results[s][key][k] for s in seeds])
                                                      for k in ("loss", *TRL_METRICS)) + " |")
    command = invocation(__file__, ["--seeds", *map(str, seeds), f"--sft-steps={args.sft_steps}",
                                    f"--dpo-steps={args.dpo_steps}", f"--pairs={args.pairs}",
                                    f"--trials={args.trials}",
                                    *(f"--{name}={portable(str(path))}" for name, path in
                                      (("runs", args.runs), ("out", args.out)) if path not in (RUNS, RESULTS))])
    where = provenance(command, "cpu, 8 virtual devices").replace("compiled memory analysis, nothing allocated",
                                                                 "trained and evaluated on the CPU")
    lr = next(o.split("=")[1] for o in DPO if o.startswith("train.lr="))
    text = (
        f"# DPO at long context, on the CPU mesh (measured)\n\n{headline}\n\n{where} {total:.1f} minutes in all "
        f"({', '.join(f'seed {s}: {m:.1f}' for s, m in minutes.items())}), beside other work on the machine "
        f"(the load average over a minute: {load[0]:.1f} at the start, {load[1]:.1f} at the end).\n\n"
        "The tiny model of configs/tiny.yaml (2 layers of 128) with experiments/chat_finetune.py's byte-level "
        "tokenizer and ChatML template. Each seed (train.seed, and its own fine-tuning conversations and "
        f"preference pairs): {args.sft_steps} steps of supervised fine-tuning from random weights on "
        f"conversations whose user turn is {SFT_TURN[0]}-{SFT_TURN[1]} bytes of filler with \"The code is N.\" "
        "(one digit, the only one in the turn) at a random depth, then \"What is the code?\", the assistant "
        f"answering \"N\" (conversations of {tokens['sft']} tokens, packed in rows of 128 on data 8); then "
        f"{args.dpo_steps} steps of DPO (train.objective dpo, beta {BETA}, every weight trained, lr {lr}) from "
        f"those weights on {args.pairs} pairs in TRL's conversational format, the user turn "
        f"{DPO_TURN[0]}-{DPO_TURN[1]} bytes (documents, prompt and completion, of {tokens['dpo']} tokens), chosen "
        "the code and rejected another digit; one pair a row of 768 tokens (train.seq_len) on sp 4 x fsdp 2, "
        "each document crossing the sequence shards. The reference is the fine-tuned model: its "
        "log-probabilities of every pair computed once before DPO's step 1 (full fine-tuning), so step 1's "
        "loss is log 2 = 0.6931.\n\n"
        f"Held-out pairs: {args.trials} for each depth of the code, the user turn {HELD_OUT_TURN} bytes "
        f"(documents of {tokens['held_out']} tokens, several times the fine-tuning's), the same pairs for every "
        "seed; each completion's log-probability summed as the objective sums it, under the fine-tuned weights "
        "(the reference) and the DPO weights (the policy). \"prefers\" is the share of pairs whose faithful "
        "answer the model itself gives the higher log-probability (chance 0.5); rewards/accuracies is TRL's: the "
        "share of pairs whose reward beta (log pi - log ref) is higher for the chosen answer (before DPO every "
        "reward is 0 and a tie does not count, so it is 0 there by construction). The mean over seeds "
        f"{', '.join(map(str, seeds))}, then [the lowest, the highest] seed's:\n\n" + "\n".join(table) + "\n\n"
        "DPO's own metrics on its training batches (8 pairs a step; the mean over the seeds, then [the lowest, "
        "the highest] seed's):\n\n" + "\n".join(training) + "\n\n"
        "The completion is the answer digit, <|im_end|> and the newline after it (TRL's completion: everything "
        "after the prompt's generation prompt). The fine-tuning never trained that newline, which makes up "
        "most of logps/chosen and logps/rejected. Figures that depend on the machine: all of them (XLA:CPU's "
        "arithmetic differs between processors, and a tiny model's training amplifies it).\n")
    (args.out / "dpo-long-context.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
