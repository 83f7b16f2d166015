"""How fast `jlong prepare` tokenizes, against the `tokenizers` library's own
batch encoding of the same documents, at each number of cores.

The corpus is built from text on this machine (Python's standard library:
source files and documentation, one document per file, as JSON Lines) up to
--corpus-mb, and a byte-level BPE tokenizer of --vocab ids is trained on its
first 16 MB. For each worker count W (1 to the machine's cores) it times:

- `jlong prepare` as a whole command in a fresh process (start-up, reading,
  tokenizing, writing the token file, the index, the summary and the plot);
- the reference: a fresh process that reads the same JSON Lines, parses each
  line and hands the texts to `Tokenizer.encode_batch_fast` in batches (the
  library's fastest batch path, no offsets), writing nothing;
- once, one document at a time through `Tokenizer.encode` (prepare's loop
  before it batched), for scale.

Usage: python experiments/prepare_throughput.py [--corpus-mb 168] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from common import invocation, markdown_table, provenance, write_result

REFERENCE = """
import json, sys, time
from tokenizers import Tokenizer
tokenizer = Tokenizer.from_file(sys.argv[1])
began, tokens, batch, size = time.perf_counter(), 0, [], 0
def flush(batch):
    return sum(len(e.ids) + 1 for e in tokenizer.encode_batch_fast(batch, add_special_tokens=False))
with open(sys.argv[2], encoding="utf-8") as lines:
    for line in lines:
        text = json.loads(line)["text"]
        batch.append(text)
        size += len(text)
        if size >= 1 << 22 or len(batch) >= 4096:
            tokens += flush(batch)
            batch, size = [], 0
tokens += flush(batch) if batch else 0
print(tokens)
"""


def build_corpus(path: Path, megabytes: int) -> int:
    """Text files of the standard library as JSON Lines, in name order, up to `megabytes`; documents written."""
    root = Path(sysconfig.get_paths()["stdlib"])
    budget, count = megabytes * 10**6, 0
    with path.open("w", encoding="utf-8") as out:
        for file in sorted(root.rglob("*")):
            if file.suffix not in (".py", ".txt", ".rst", ".md") or not file.is_file():
                continue
            try:
                text = file.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                out.write(json.dumps({"text": text}) + "\n")
                count += 1
                budget -= len(text.encode("utf-8"))
                if budget <= 0:
                    break
    return count


def train_tokenizer(corpus: Path, vocab: int, out: Path) -> int:
    """A byte-level BPE tokenizer trained on the corpus' first 16 MB; its end-of-document id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        seen = 0
        with corpus.open(encoding="utf-8") as lines:
            for line in lines:
                text = json.loads(line)["text"]
                seen += len(text)
                yield text
                if seen > 16 * 10**6:
                    return

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts(), trainer)
    tokenizer.save(str(out))
    return tokenizer.token_to_id("<|endoftext|>")


def timed(command: list[str], workers: int) -> tuple[float, str]:
    env = {**os.environ, "RAYON_NUM_THREADS": str(workers)}
    began = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - began, done.stdout


def one_at_a_time(tokenizer_file: Path, corpus: Path) -> tuple[float, int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    began, tokens = time.perf_counter(), 0
    with corpus.open(encoding="utf-8") as lines:
        for line in lines:
            tokens += len(tokenizer.encode(json.loads(line)["text"], add_special_tokens=False).ids) + 1
    return time.perf_counter() - began, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-mb", type=int, default=168)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--work", help="where the corpus and outputs go (default: a temporary directory)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="prepare-throughput-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus, tokenizer_file = work / "corpus.jsonl", work / "tokenizer.json"
    documents = build_corpus(corpus, args.corpus_mb)
    eos_id = train_tokenizer(corpus, args.vocab, tokenizer_file)
    cores = os.cpu_count() or 1
    rows, results = [], []
    for workers in range(1, cores + 1):
        out = work / f"tokens-{workers}.npy"
        for stale in work.glob(f"tokens-{workers}*"):
            stale.unlink()
        ours, _ = timed([sys.executable, "-m", "jlong", "prepare", str(out), str(corpus), "--tokenizer",
                         str(tokenizer_file), "--eos-id", str(eos_id), "--workers", str(workers)], workers)
        theirs, printed = timed([sys.executable, "-c", REFERENCE, str(tokenizer_file), str(corpus)], workers)
        tokens = int(printed.strip())
        written = len(__import__("numpy").load(out, mmap_mode="r"))
        if written != tokens:
            raise SystemExit(f"prepare wrote {written} tokens, the reference counted {tokens}")
        results.append({"workers": workers, "tokens": tokens, "prepare_s": ours, "reference_s": theirs})
        rows.append([workers, f"{tokens / ours:,.0f}", f"{tokens / theirs:,.0f}", f"{theirs / ours:.2f}",
                     f"{ours:.1f}", f"{theirs:.1f}"])
    single_s, single_tokens = one_at_a_time(tokenizer_file, corpus)
    size_mb = corpus.stat().st_size / 1e6
    text = "\n".join([
        "# jlong prepare against the tokenizers library's batch encoding",
        "",
        provenance(invocation(__file__, ["--corpus-mb", str(args.corpus_mb), "--vocab", str(args.vocab)]),
                   f"{cores} cores used", "measured on this machine")
        + f" Corpus: {documents:,} documents ({size_mb:.0f} MB of JSON Lines: the "
        f"standard library's text files), {results[0]['tokens']:,} tokens with a {args.vocab:,}-id byte-level BPE. "
        "prepare is the whole command in a fresh process (start-up, index, summary and plot included); the "
        "reference is a fresh process that parses the same lines and calls `encode_batch_fast` in batches, "
        "writing nothing. Workers set RAYON_NUM_THREADS for both (prepare's `--workers`).",
        "",
        markdown_table(["workers", "prepare tokens/s", "reference tokens/s", "ratio", "prepare s", "reference s"],
                       rows),
        "",
        f"One document at a time through `Tokenizer.encode` (prepare's loop before it batched; tokenizing only, "
        f"in this process): {single_tokens / single_s:,.0f} tokens/s ({single_s:.1f} s).",
        "",
    ])
    print(text)
    write_result("prepare-throughput.md", text)
    (work / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
