"""Greedy generation speed on the CPU: jlong's sampler against transformers'
`generate` on the same tiny model (the `tiny-llama` preset's architecture,
random weights written once as a Hugging Face checkpoint both read), the
same prompts, float32, on this machine's cores.

    python experiments/generate_speed.py [--batch 8] [--prompt-tokens 512] [--new-tokens 128] [--reps 3]

Both decode greedily to exactly --new-tokens tokens (no stop id), so both do
the same work; each figure is the median of --reps timed calls after one
untimed call (jlong's compilation, torch's first-call setup), prefill
included. jlong runs on one CPU device (mesh 1 x 1 x 1 x 1); torch with its
default threads. The tokens of the two must agree (float32 ties aside): the
script says how many do. Writes experiments/results/generate-speed.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
from common import invocation, provenance, provenance_record, write_result


def _timed(fn, reps: int) -> tuple[object, float]:
    fn()  # compile / warm up
    times, result = [], None
    for _ in range(reps):
        began = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - began)
    return result, statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    import jax
    import torch
    import transformers

    import jlong.components  # noqa: F401
    from jlong.config import load_config
    from jlong.generation.sampler import Request, Sampler
    from jlong.generation.sampling import SamplingSettings
    from jlong.hf_config import hf_config_dict
    from jlong.parallel.placement import make_mesh
    from jlong.program.train_program import TrainProgram

    B, S, M = args.batch, args.prompt_tokens, args.new_tokens
    work = Path(tempfile.mkdtemp(prefix="generate-speed-"))
    preset = load_config(None, ["model.preset=tiny-llama"])
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(**hf_config_dict(preset.model))
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    hf_model.save_pretrained(work / "hf")
    prompts = np.random.default_rng(0).integers(0, preset.model.vocab_size, (B, S))

    config = load_config(None, [f"model.hf_path={work / 'hf'}", f"train.seq_len={S + M}", f"train.batch_size={B}",
                                "train.compute_dtype=float32", "data.source=synthetic"])
    program = TrainProgram(config, make_mesh(config.mesh, jax.devices()[:1]))
    params = program.starting_params()
    sampler = Sampler(program)
    request = Request(M, SamplingSettings(temperature=0.0))
    jlong_out, jlong_s = _timed(lambda: sampler.generate(params, prompts.tolist(), request), args.reps)

    input_ids = torch.as_tensor(prompts)

    def torch_generate():
        with torch.no_grad():
            return hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=M,
                                     min_new_tokens=M, do_sample=False, pad_token_id=0)

    torch_out, torch_s = _timed(torch_generate, args.reps)
    torch_ids = torch_out[:, S:].numpy()
    agreeing = sum(c.ids == torch_ids[c.prompt_index].tolist() for c in jlong_out)
    tokens = B * M
    rows = {
        "jlong": {"seconds": jlong_s, "tokens_per_s": tokens / jlong_s},
        "transformers": {"seconds": torch_s, "tokens_per_s": tokens / torch_s},
    }
    ratio = rows["jlong"]["tokens_per_s"] / rows["transformers"]["tokens_per_s"]
    command = invocation(__file__)
    record = {**provenance_record(command), "batch": B, "prompt_tokens": S, "new_tokens": M, "reps": args.reps,
              "versions": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
              "torch_threads": torch.get_num_threads(), "rows": rows, "ratio": ratio,
              "same_tokens": f"{agreeing} of {B} completions"}
    write_result("generate-speed.json", json.dumps(record, indent=2) + "\n")
    text = "\n".join([
        "# Greedy generation on the CPU: jlong against transformers' generate", "",
        provenance(command, compiler=f"cpu, 1 device for jlong; torch with {torch.get_num_threads()} threads",
                   how="measured, median of the timed calls after one untimed call, prefill included"), "",
        f"Tiny Llama (the tiny-llama preset's shape, random weights, float32), batch {B}, prompts of {S} tokens, "
        f"{M} new tokens each, greedy, no stop id.", "",
        "| | seconds | tokens/s |", "|---|---|---|",
        *(f"| {name} | {row['seconds']:.3f} | {row['tokens_per_s']:,.0f} |" for name, row in rows.items()), "",
        f"jlong / transformers: **{ratio:.2f}x** tokens/s; the same greedy tokens in {agreeing} of {B} completions.",
        "",
    ])
    write_result("generate-speed.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
