"""The same training run as `jlong train CONFIG`, in PyTorch with Hugging Face
`transformers`: the model from `model.hf_path`, the token file's batches by
the same rule, AdamW with the same decay mask, clipping and schedule, SDPA
attention, optional gradient checkpointing. Writes `metrics.jsonl` with
jlong's fields into --run-dir.

    python experiments/torch_baseline.py CONFIG.yaml [key=value ...] --run-dir DIR
        [--device cpu|cuda] [--checkpointing]

Supports what a Hugging Face model can do as jlong does: `data.source=tokens`
without shuffling or document packing (no segment ids), one device.
Float32 on CPU; on a GPU the config's compute dtype (bf16 autocast over
float32 parameters, as jlong keeps them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers

from jlong.config import Config, load_config
from jlong.errors import JlongError
from jlong.families import family_of
from jlong.hf import hf_tensor_names
from jlong.program.optimizer import learning_rate


def batch_tokens(tokens: np.ndarray, step: int, seq_len: int, batch_size: int) -> np.ndarray:
    """[B, S + 1] windows of 1-based `step`: sample i is tokens[i*S : i*S + S + 1],
    indices wrap modulo the number of whole samples."""
    samples = (len(tokens) - 1) // seq_len
    first = (step - 1) * batch_size
    starts = [(i % samples) * seq_len for i in range(first, first + batch_size)]
    return np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])


def parameter_groups(model: torch.nn.Module, config: Config) -> list[dict]:
    """Decay where jlong decays: by each tensor's role in jlong's parameter
    layout (matrices, not norms or biases)."""
    role = family_of(config.model).roles(config.model)
    roles = {tensor: role[keys[-1]] for keys, stored in hf_tensor_names(config.model).items()
             for tensor in stored.names}
    decay, plain = [], []
    for name, param in model.named_parameters():
        (decay if roles[name].decays else plain).append(param)
    return [{"params": decay, "weight_decay": config.train.weight_decay}, {"params": plain, "weight_decay": 0.0}]


def check_supported(config: Config) -> None:
    if not config.model.hf_path:
        raise JlongError("the baseline starts from a Hugging Face checkpoint: set model.hf_path")
    if config.data.source != "tokens" or config.data.shuffle or config.data.eos_id is not None:
        raise JlongError("the baseline reads data.source=tokens in order (data.shuffle=false, no data.eos_id)")


def train(config: Config, run_dir: Path, *, device: str = "cpu", checkpointing: bool = False) -> list[dict]:
    check_supported(config)
    train_cfg = config.train
    torch.manual_seed(train_cfg.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        config.model.hf_path, dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(
        parameter_groups(model, config), lr=train_cfg.lr,
        betas=(train_cfg.b1, train_cfg.b2), eps=train_cfg.eps,
    )
    autocast_dtype = getattr(torch, train_cfg.compute_dtype) if device != "cpu" else torch.float32
    tokens = np.load(config.data.path, mmap_mode="r")
    run_dir.mkdir(parents=True, exist_ok=True)
    records = []
    with open(run_dir / "metrics.jsonl", "w") as metrics:
        for step in range(1, train_cfg.steps + 1):
            window = torch.as_tensor(batch_tokens(tokens, step, train_cfg.seq_len, train_cfg.batch_size), device=device)
            inputs, targets = window[:, :-1], window[:, 1:]
            if device != "cpu":
                torch.cuda.synchronize()
            began = time.perf_counter()
            with torch.autocast(device_type=device, dtype=autocast_dtype, enabled=device != "cpu"):
                logits = model(input_ids=inputs, use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip or float("inf"))
            lr = float(learning_rate(train_cfg, step))  # jlong's schedule, 1-based steps
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            loss_value, norm_value = float(loss.detach()), float(grad_norm)  # waits for the step
            seconds = time.perf_counter() - began
            record = {
                "step": step, "loss": loss_value, "grad_norm": norm_value, "lr": lr,
                "tokens_per_s": train_cfg.batch_size * train_cfg.seq_len / seconds, "step_time_s": seconds,
            }
            if device != "cpu":
                record["peak_bytes"] = int(torch.cuda.max_memory_allocated())
            records.append(record)
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--checkpointing", action="store_true", help="Hugging Face gradient checkpointing")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        records = train(config, args.run_dir, device=args.device, checkpointing=args.checkpointing)
    except JlongError as err:
        print(f"torch_baseline: error: {err}", file=sys.stderr)
        return 2
    last = records[-1]
    print(f"{len(records)} steps; last loss {last['loss']:.4f}, {last['tokens_per_s']:.0f} tokens/s; "
          f"metrics in {args.run_dir / 'metrics.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
