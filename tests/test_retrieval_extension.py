"""A guard on context extension (experiments/retrieval_extension.py, shortened): a tiny byte model trained
at 128 tokens on passkey documents, then either extended to 256 (a larger RoPE base) or trained as long at
128 (the control), on the same documents. Beyond the base length only the extended model keeps its loss:
the longer context, not the extra training, is what helps. The margins hold across seeds (measured with
train.seed 0-2 on this layout: control / extended beyond 128 tokens 1.84-2.00, the control's rise past 128
1.42-1.48, the extended model's 1.02-1.06)."""

import pytest
from helpers import REPO, load_experiment

import jlong
from jlong.data.prepare import prepare

TINY = REPO / "configs" / "tiny.yaml"
COMMON = ["data.sampling=documents", "train.warmup_steps=20", "checkpoint.every=0", "mesh.data=8", "mesh.fsdp=1",
          "mesh.sp=1"]


def _loss_by_bucket(result: dict) -> dict[int, float]:
    return {bucket["start"]: bucket["loss"] for bucket in result["loss_by_position"]}


@pytest.mark.slow  # 500 training steps: the long tier
def test_an_extended_model_keeps_its_loss_beyond_the_base_length_where_the_control_does_not(tmp_path):
    corpus = load_experiment("retrieval_extension").corpus
    short, mixed, held_out = (tmp_path / f"{name}.npy" for name in ("short", "mixed", "held-out"))
    prepare(str(short), [str(corpus(tmp_path / "short.jsonl", 0, [(1500, 90, 125)]))])
    prepare(str(mixed), [str(corpus(tmp_path / "mixed.jsonl", 1, [(1500, 90, 125), (1000, 90, 250)]))])
    prepare(str(held_out), [str(corpus(tmp_path / "held-out.jsonl", 2, [(100, 200, 250)]))])

    def train(name, *overrides):
        jlong.train(TINY, [*COMMON, f"run_dir={tmp_path / name}", f"checkpoint.dir={tmp_path / name / 'ckpt'}",
                           *overrides])

    train("base", "train.seq_len=128", f"data.path={short}", "train.steps=300")
    more = [f"data.path={mixed}", "data.long_document_weight=2", "train.steps=100",
            f"train.init_from={tmp_path / 'base' / 'ckpt'}"]
    train("extended", *more, "train.seq_len=256", "model.rope_theta=40000.0")
    train("control", *more, "train.seq_len=128")
    held = ["train.seq_len=256", "eval.passkey_trials=0", "mesh.data=8", "mesh.fsdp=1", "mesh.sp=1", f"eval.path={held_out}",
            "eval.sequences=16", "data.source=synthetic", "data.path=null"]
    extended = _loss_by_bucket(jlong.evaluate(TINY, tmp_path / "extended" / "ckpt", [*held, "model.rope_theta=40000.0"]))
    control = _loss_by_bucket(jlong.evaluate(TINY, tmp_path / "control" / "ckpt", held))
    # positions [128, 256): beyond the base length; [64, 128): within it
    assert control[128] >= 1.5 * extended[128], (extended, control)
    assert control[128] >= 1.3 * control[64] and extended[128] <= 1.15 * extended[64], (extended, control)
