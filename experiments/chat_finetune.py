"""Fine-tuning on long conversations, on the CPU mesh: a small model is
pretrained at 256 tokens, extended to 1,024, then fine-tuned on synthetic
conversations whose answer is a code stated somewhere in a long user turn
("The code is 7." in filler, then "What is the code?"; the assistant
answers "7"); held-out accuracy by the code's depth before and after
fine-tuning. The code is one digit: copying a longer code needs an
induction circuit, which this 2-layer model does not form in minutes of CPU
training (in a probe, a five-digit code copied from a random earlier place
stayed at chance after 2,000 steps). The pretraining documents hold the
same retrieval as plain text (the question answered in the text), but the
answer is one token in hundreds and the extended model retrieves at chance;
the fine-tuning, whose loss is the answer alone, runs two thirds of its
steps on short conversations at 256 tokens and the rest on long ones at
1,024.

The tokenizer is byte-level (ids 0-255 are the bytes) with ChatML's special
tokens added (<|im_start|> 256, <|im_end|> 257, <|endoftext|> 258) and a
ChatML chat template: the chat starter's (`jlong.data.chat_starter`, shipped
as configs/tokenizers/byte-chatml), written under the run directory. Everything goes through
jlong: `jlong.data.prepare.prepare` (plain text, then `chat=True`, which
masks all but the assistant's answer), `jlong.train` (the end-of-document
id and the mask read from the token files), and the run's own forward pass
to score held-out conversations.

    python experiments/chat_finetune.py [--base-steps 1500] [--extend-steps 300] [--chat-steps 900]

Writes experiments/results/chat-finetune.md (and .json) and runs under
runs/chat-finetune/ (every run resumes a checkpoint it finds there).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

import jlong
from common import invocation, provenance, provenance_record
from jlong.data.chat_starter import write_tokenizer
from jlong.data.prepare import prepare
from jlong.eval.passkey import FILLER

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
RUNS = ROOT / "runs" / "chat-finetune"
SENTENCES = [s.strip() + "." for s in FILLER.replace("\n", " ").split(".") if s.strip()]
NEEDLE = "The code is {key}. "  # one digit; the filler has none
QUESTION = "What is the code?"
DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]
LENGTH = 900  # bytes of the held-out user turns: beyond the base length of 256, within 1,024 tokens


def byte_tokenizer(directory: Path) -> Path:
    """Bytes as ids 0-255 plus ChatML's special tokens, with the template: the chat starter's tokenizer
    (`jlong.data.chat_starter.write_tokenizer`, shipped as configs/tokenizers/byte-chatml)."""
    return write_tokenizer(directory)


def filler_with_key(rng: random.Random, length: int, depth: float | None = None, *,
                    times: int = 1) -> tuple[str, str]:
    """(text of about `length` bytes with the code's sentence `times` times, the first at `depth`
    (random when None), the code)."""
    key = str(rng.randint(0, 9))
    needle = NEEDLE.format(key=key)
    room = max(length - times * len(needle), 0)
    filler = ""
    while len(filler) < room:
        filler += rng.choice(SENTENCES) + " "
    filler = filler[:room]
    first = round((rng.random() if depth is None else depth) * len(filler))
    places = sorted([first, *(rng.randint(first, len(filler)) for _ in range(times - 1))], reverse=True)
    for at in places:  # from the back, so the places stay where they were drawn
        filler = filler[:at] + needle + filler[at:]
    return filler, key


def plain_corpus(path: Path, seed: int, count: int, low: int, high: int) -> Path:
    """Code-retrieval documents as plain text: the code's sentence stated one to five times, then the
    question answered (each repetition after the first is a retrieval the loss trains)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            text, key = filler_with_key(rng, rng.randint(low, high), times=rng.randint(1, 5))
            f.write(json.dumps({"text": f"{text}{QUESTION} {key}\n"}) + "\n")
    return path


def conversation(rng: random.Random, length: int, depth: float | None = None) -> tuple[list[dict], str]:
    text, key = filler_with_key(rng, length, depth)
    return [{"role": "user", "content": text + QUESTION}, {"role": "assistant", "content": key}], key


def chat_corpus(path: Path, seed: int, count: int, low: int, high: int) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            f.write(json.dumps({"messages": conversation(rng, rng.randint(low, high))[0]}) + "\n")
    return path


def prepared(path: Path, source: Path, tokenizer: Path, **options) -> Path:
    if not path.exists():
        prepare(str(path), [str(source)], tokenizer_path=str(tokenizer), **options)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-steps", type=int, default=1500)
    parser.add_argument("--extend-steps", type=int, default=300)
    parser.add_argument("--chat-steps", type=int, default=900, help="two thirds at 256 tokens, the rest at 1,024")
    parser.add_argument("--trials", type=int, default=16, help="held-out conversations per depth")
    args = parser.parse_args()
    began = time.perf_counter()
    RUNS.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_tokenizer(RUNS / "tokenizer")
    # Plain text ends with <|endoftext|> (258), as the conversations do.
    short = prepared(RUNS / "short.npy", plain_corpus(RUNS / "short.jsonl", 0, 6000, 180, 250), tokenizer, eos_id=258)
    mixed = prepared(RUNS / "mixed.npy", plain_corpus(RUNS / "mixed.jsonl", 1, 3000, 180, 1000), tokenizer,
                     eos_id=258)
    short_chats = prepared(RUNS / "short-chats.npy", chat_corpus(RUNS / "short-chats.jsonl", 2, 8000, 100, 250),
                           tokenizer, chat=True)
    chats = prepared(RUNS / "chats.npy", chat_corpus(RUNS / "chats.jsonl", 3, 4000, 180, 1000), tokenizer, chat=True)
    tiny = ROOT / "configs" / "tiny.yaml"
    common = ["model.vocab_size=320", "data.sampling=documents", "data.eos_id=null", "train.warmup_steps=50",
              "checkpoint.every=0"]

    def run(name: str, *overrides: str) -> list[dict]:
        return jlong.train(tiny, [*common, f"run_dir={RUNS / name}", f"checkpoint.dir={RUNS / name / 'ckpt'}",
                                  *overrides])

    run("base", "train.seq_len=256", f"data.path={short}", f"train.steps={args.base_steps}")
    half = args.extend_steps // 2
    run("extended", f"data.path={mixed}", f"train.steps={args.extend_steps}", "train.seq_len=512",
        f"train.init_from={RUNS / 'base' / 'ckpt'}",
        f"stages=[{{until_step: {half}, set: {{train.seq_len: 512, model.rope_theta: 40000.0}}}}, "
        f"{{until_step: {args.extend_steps}, set: {{train.seq_len: 1024, model.rope_theta: 100000.0}}}}]")
    # Short conversations first (the retrieval is learned at short range), then long ones at the full length.
    short = 2 * args.chat_steps // 3
    records = run("chat", f"data.path={short_chats}", f"train.steps={args.chat_steps}", "train.seq_len=256",
                  "model.rope_theta=100000.0", f"train.init_from={RUNS / 'extended' / 'ckpt'}",
                  f"stages=[{{until_step: {short}, set: {{train.seq_len: 256}}}}, {{until_step: {args.chat_steps}, "
                  f"set: {{train.seq_len: 1024, data.path: {chats}}}}}]")
    accuracy = {name: accuracy_by_depth(RUNS / name / "ckpt", tokenizer, args.trials)
                for name in ("extended", "chat")}
    trained = sum(r["trained_tokens"] for r in records)
    report(accuracy, args, trained, (time.perf_counter() - began) / 60)


def accuracy_by_depth(checkpoint: Path, tokenizer: Path, trials: int) -> dict[float, float]:
    """Held-out conversations (the user turn about LENGTH bytes, the code at each depth), teacher-forced:
    the share whose answer digit is the model's most likely next token (chance: 0.1)."""
    from jlong.config import load_config
    from jlong.data.chat import ChatEncoder, checked_messages
    from jlong.eval.evaluate import Evaluator, load_params
    from jlong.parallel.placement import make_mesh
    from jlong.program.train_program import TrainProgram

    config = load_config(ROOT / "configs" / "tiny.yaml", [
        "model.vocab_size=320", "model.rope_theta=100000.0", "train.seq_len=1024", "data.source=synthetic",
        "data.path=null", "data.eos_id=258", "train.batch_size=8"])
    encoder = ChatEncoder.load(str(tokenizer), "last", None)
    rng = random.Random(7)
    rows, answers, depths = [], [], []
    for depth in DEPTHS:
        for _ in range(trials):
            chat, key = conversation(rng, LENGTH, depth)
            ids, trained = encoder.encode(checked_messages(chat, "held-out"), "held-out")
            targets = np.flatnonzero(trained)[: len(key)]  # the digit; <|im_end|> after it
            row = np.full(config.train.seq_len + 1, encoder.eos_id, np.int32)
            row[: len(ids)] = ids
            rows.append(row)
            answers.append(targets - 1)  # the positions that predict them
            depths.append(depth)
    program = TrainProgram(config, make_mesh(config.mesh))
    params, _ = load_params(program, str(checkpoint))
    hits = Evaluator(program).scores(params, np.stack(rows))[..., 1]
    right = np.array([hits[i, positions].all() for i, positions in enumerate(answers)])
    return {depth: float(right[np.array(depths) == depth].mean()) for depth in DEPTHS}


def report(accuracy: dict, args, trained: int, minutes: float) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = invocation(__file__, [f"--base-steps={args.base_steps}", f"--extend-steps={args.extend_steps}",
                                    f"--chat-steps={args.chat_steps}", f"--trials={args.trials}"])
    (RESULTS / "chat-finetune.json").write_text(json.dumps({"accuracy_by_depth": accuracy, "trained_tokens": trained,
                                                             "provenance": provenance_record(command)},
                                                            indent=1) + "\n")
    names = {"extended": f"extended (before fine-tuning): {args.base_steps} steps at 256 + {args.extend_steps} "
                         "in stages to 1,024", "chat": f"+ {args.chat_steps} steps on conversations: {2 * args.chat_steps // 3} at 256, the rest at 1,024"}
    rows = ["| model | " + " | ".join(f"depth {d:.2f}" for d in DEPTHS) + " |", "|---|" + "---|" * len(DEPTHS)]
    for name, label in names.items():
        rows.append(f"| {label} | " + " | ".join(f"{accuracy[name][d]:.2f}" for d in DEPTHS) + " |")
    text = (f"# Fine-tuning on long conversations, on the CPU mesh (measured)\n\n"
            f"{provenance(command, 'cpu, 8 virtual devices: fsdp 2 x sp 4').replace('compiled memory analysis, nothing allocated', 'trained and evaluated on the CPU')} "
            f"{minutes:.1f} minutes in all. The tiny model of configs/tiny.yaml (2 layers of 128) with a byte-level "
            "tokenizer plus ChatML's special tokens. The conversations: a user turn of 100-250 bytes (the first two "
            "thirds of the fine-tuning, at 256 tokens) or 180-1,000 bytes (the rest, at 1,024) of filler "
            "with \"The code is N.\" (one digit, the only one in the turn) at a random depth, then \"What is the "
            "code?\"; the assistant answers \"N\". Pretraining (all tokens) and extension used the same retrieval as "
            "plain text, the code's sentence stated one to five times. "
            f"`jlong prepare --chat` masks all but the answer and its <|im_end|>: {trained:,} trained tokens in "
            "the fine-tuning run.\n\nHeld-out accuracy by the code's depth in a user turn of about "
            f"{LENGTH} bytes ({args.trials} conversations per depth; right when the answer digit is the most "
            "likely next token; chance is 0.1):\n\n" + "\n".join(rows) + "\n\nFigures that depend on the machine: all of them (XLA:CPU's "
            "arithmetic differs between processors, and a tiny model's training amplifies it); one seed.\n")
    (RESULTS / "chat-finetune.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
