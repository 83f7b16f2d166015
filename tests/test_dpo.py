"""DPO's objective: its loss and gradients equal a computation apart on every
layout, with pairs packed several to a row and split across sequence
shards; a policy that equals its reference has loss log 2 and no reward,
with full fine-tuning (reference log-probabilities in the batch) and with
LoRA (the base with the adapters off, in the same step)."""

import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL_MODEL, assert_same_result

from jlong.config import load_config
from jlong.parallel.placement import make_mesh
from jlong.data.sources import REFERENCE_LOGPS as REFERENCE
from jlong.program.train_program import TrainProgram

EOS = 7
BETA = 0.3
DPO = ["train.objective=dpo", "data.source=tokens", "data.path=unused.npy", f"data.eos_id={EOS}",
       f"train.dpo_beta={BETA}", "attention.max_documents=8"]
LAYOUTS = {
    "fsdp8": ["mesh.fsdp=8"],
    "sp4-fsdp2-tiled": ["mesh.sp=4", "mesh.fsdp=2", "memory.loss_tile=8"],
    "ring2-sp2-fsdp2": ["mesh.ring=2", "mesh.sp=2", "mesh.fsdp=2"],
}


def pair_rows(B=8, S=64, seed=0, vocab=128):
    """Rows of whole pairs, as data.sampling=pairs lays them out: each pair's
    chosen then rejected document (prompt + completion, eos after each),
    padding after the last; `pair_documents` is the completion slot of each
    target (2p chosen, 2p + 1 rejected, -1 none). Documents of 6-20 tokens
    cross the 16-token shards of sp 4."""
    rng = np.random.default_rng(seed)
    tokens = np.full((B, S + 1), 1, np.int32)  # padding: one document of filler
    slots = np.full((B, S + 1), -1, np.int32)  # the slot of each token that is a completion token
    for b in range(B):
        at, pair = 0, 0
        while pair < 4:
            prompt = rng.integers(8, vocab, rng.integers(2, 10))
            chosen, rejected = (rng.integers(8, vocab, rng.integers(2, 9)) for _ in range(2))
            if at + 2 * len(prompt) + len(chosen) + len(rejected) + 2 > S + 1:
                break
            for kind, completion in enumerate((chosen, rejected)):
                document = np.concatenate([prompt, completion, [EOS]])
                tokens[b, at:at + len(document)] = document
                slots[b, at + len(prompt):at + len(prompt) + len(completion)] = 2 * pair + kind
                at += len(document)
            pair += 1
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    starts = np.zeros(inputs.shape, bool)
    starts[:, 0], starts[:, 1:] = True, inputs[:, :-1] == EOS
    segment_ids = np.cumsum(starts, axis=1, dtype=np.int32) - 1
    index = np.arange(S, dtype=np.int32)
    positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    documents = slots[:, 1:]
    return {"inputs": inputs, "targets": targets, "segment_ids": segment_ids, "positions": positions.astype(np.int32),
            "loss_mask": documents >= 0, "pair_documents": documents}


def dpo_apart(logits_BSV, batch, reference_BN):
    """TRL's formula in float64 from whole logits: -logsigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))),
    sums over completion tokens, the mean over pairs."""
    logits = np.asarray(logits_BSV, np.float64)
    logps = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    target = np.take_along_axis(logps, batch["targets"][..., None], axis=-1)[..., 0]
    losses = []
    for b in range(target.shape[0]):
        slots = batch["pair_documents"][b]
        for p in range(slots.max() // 2 + 1):
            pi_c, pi_r = target[b][slots == 2 * p].sum(), target[b][slots == 2 * p + 1].sum()
            margin = (pi_c - reference_BN[b, 2 * p]) - (pi_r - reference_BN[b, 2 * p + 1])
            losses.append(np.log1p(np.exp(-BETA * margin)))
    return float(np.mean(losses))


def _program(*overrides, devices=None):
    config = load_config(None, [*SMALL_MODEL, *DPO, *overrides])
    return TrainProgram(config, make_mesh(config.mesh, devices if devices is not None else jax.devices()))


@pytest.fixture(scope="module")
def one_device():
    """The one-device model's loss, gradients and logits, with a reference its own logps moved by noise."""
    program = _program(devices=jax.devices()[:1])
    params = program.init_params(seed=0)
    batch = pair_rows()
    own = program.bind(params).document_logps_and_routing(program.place_batch(batch), 8)[0]
    reference = np.asarray(own) + np.random.default_rng(1).normal(0, 1.0, own.shape).astype(np.float32)
    placed = program.place_batch({**batch, REFERENCE: reference})
    loss, grads = jax.jit(jax.value_and_grad(program.loss))(params, placed)
    logits = program.bind(params)(batch["inputs"], batch["segment_ids"], batch["positions"])
    return float(loss), jax.tree.map(np.asarray, grads), np.asarray(logits), reference


def test_the_loss_equals_trls_formula_computed_apart(one_device):
    loss, _, logits, reference = one_device
    np.testing.assert_allclose(loss, dpo_apart(logits, pair_rows(), reference), rtol=1e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_loss_and_gradients_on_a_layout_equal_one_device(layout, one_device):
    loss, grads, _, reference = one_device
    program = _program(*LAYOUTS[layout])
    params = program.init_params(seed=0)
    placed = program.place_batch({**pair_rows(), REFERENCE: reference})
    got = jax.jit(jax.value_and_grad(program.loss))(params, placed)
    assert_same_result((float(got[0]), jax.tree.map(np.asarray, got[1])), (loss, grads))


@pytest.mark.parametrize("layout", ["ring2-sp2-fsdp2"])
def test_a_policy_equal_to_its_reference_has_loss_log_2_and_no_reward(layout):
    """Full fine-tuning at step 1: the reference log-probabilities are the
    initial model's own (computed on one device), the step's metrics say so
    (on Ulysses too: the run below, whose reference pass is its own)."""
    single = _program(devices=jax.devices()[:1])
    params = single.init_params(seed=0)
    batch = pair_rows()
    own = np.asarray(single.bind(params).document_logps_and_routing(single.place_batch(batch), 8)[0])
    program = _program(*LAYOUTS[layout])
    params = program.init_params(seed=0)
    placed = program.place_batch({**batch, REFERENCE: own})
    _, _, metrics = program.step(params, program.init_opt_state(params), placed)
    np.testing.assert_allclose(float(metrics["loss"]), math.log(2), rtol=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(float(metrics[key])) < 1e-5, key
    assert float(metrics["pairs"]) == (np.asarray(batch["pair_documents"]).max(axis=1) // 2 + 1).sum()
    assert float(metrics["logps/chosen"]) < 0


def test_lora_dpo_starts_at_log_2_and_learns_without_a_second_base():
    """With LoRA the reference is the base itself (the adapters off, in the
    same step): at step 1 the loss is log 2 exactly, the reference costs no
    parameter bytes, and steps move the policy's preference."""
    program = _program("lora.rank=4", "mesh.sp=4", "mesh.fsdp=2", "train.lr=1e-2", "train.warmup_steps=0")
    assert REFERENCE not in program.abstract_batch
    params = program.init_params(seed=0)
    opt_state = program.init_opt_state(params)
    batch = program.place_batch(pair_rows())
    margins = []
    for step in range(3):
        params, opt_state, metrics = program.step(params, opt_state, batch)
        margins.append(float(metrics["rewards/margins"]))
        if step == 0:
            np.testing.assert_allclose(float(metrics["loss"]), math.log(2), rtol=1e-6)
            assert margins[0] == 0.0
    assert margins[-1] > 0 and float(metrics["loss"]) < math.log(2)


@pytest.fixture(scope="module")
def preference_file(tmp_path_factory):
    """A small preference file, `jlong prepare --preference` of string pairs with a 400-id tokenizer."""
    from chat_fixtures import chat_tokenizer
    from test_preference_data import _jsonl, string_pairs

    from jlong.data.prepare import prepare

    root = tmp_path_factory.mktemp("pairs")
    tokenizer = chat_tokenizer(root / "tokenizer", "chatml")
    out = root / "pairs.npy"
    prepare(str(out), [str(_jsonl(root / "pairs.jsonl", string_pairs(40, words=(2, 6))))],
            tokenizer_path=str(tokenizer), preference=True)
    return out


def _dpo_run(tmp_path, data, *overrides):
    from helpers import run_config

    return run_config(tmp_path, "model.vocab_size=400", "train.objective=dpo", "data.source=tokens",
                      f"data.path={data}", "data.eos_id=null", "attention.max_documents=9", "train.steps=3",
                      "train.lr=1e-3", *overrides)


def test_full_fine_tuning_computes_its_reference_once_and_starts_at_log_2(tmp_path, preference_file, capsys):
    """The initial model's log-probabilities are computed before step 1 and
    kept beside the pairs: step 1's loss is log 2 (the policy is the
    reference), and a second run reads them. The same file prepared again
    at the same path, chosen and rejected swapped, gets its own reference
    (the key holds the arrays' digest): log 2 again, not the stale values."""
    from test_preference_data import _jsonl, string_pairs

    from jlong.data.prepare import prepare
    from jlong.data.reference_cache import cache_path
    from jlong.training.loop import train

    data = tmp_path / "pairs.npy"
    for prepared in preference_file.parent.glob("pairs.*"):
        if prepared != cache_path(preference_file):
            shutil.copy(prepared, tmp_path / prepared.name)
    records = train(_dpo_run(tmp_path / "first", data))
    np.testing.assert_allclose(records[0]["loss"], math.log(2), rtol=1e-5)
    assert abs(records[0]["rewards/margins"]) < 1e-5 and records[0]["pairs"] > 0
    cache = cache_path(data)
    before = cache.read_bytes()
    again = train(_dpo_run(tmp_path / "second", data))
    assert [r["loss"] for r in again] == [r["loss"] for r in records] and cache.read_bytes() == before

    for prepared in tmp_path.glob("pairs.*"):  # prepared again: prepare never writes over a corpus
        if prepared != cache:
            prepared.unlink()
    swapped = [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in string_pairs(40, words=(2, 6))]
    prepare(str(data), [str(_jsonl(tmp_path / "swapped.jsonl", swapped))],
            tokenizer_path=str(preference_file.parent / "tokenizer"), preference=True)
    capsys.readouterr()
    records = train(_dpo_run(tmp_path / "third", data))
    assert "holds the reference log-probabilities of other data: this run computes its own" in capsys.readouterr().out
    np.testing.assert_allclose(records[0]["loss"], math.log(2), rtol=1e-5)
    assert abs(records[0]["rewards/margins"]) < 1e-5 and all(math.isfinite(r["loss"]) for r in records)


def test_jlong_eval_reports_trls_metrics_on_held_out_pairs(tmp_path, preference_file):
    """A LoRA DPO run evaluated on held-out pairs: TRL's metrics by TRL's names;
    before any step the policy is its reference (margins 0, loss log 2)."""
    from jlong.eval.evaluate import evaluate
    from jlong.training.loop import train

    config = _dpo_run(tmp_path, preference_file, "lora.rank=4", "train.lr=2e-2", f"eval.path={preference_file}",
                      "eval.passkey_trials=0", "eval.sequences=4")
    program = TrainProgram(config, make_mesh(config.mesh))
    from jlong.objectives.dpo_reference import held_out_metrics

    before = held_out_metrics(program, program.starting_params(), say=lambda _: None)
    assert before["pairs"] > 0 and before["rewards/margins"] == 0.0
    np.testing.assert_allclose(before["loss"], math.log(2), rtol=1e-6)
    train(config)
    after = evaluate(config, str(tmp_path / "ckpt"), make_mesh(config.mesh))["preference"]
    assert set(after) >= {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                          "logps/chosen", "logps/rejected"}
    assert after["pairs"] == before["pairs"] and after["rewards/margins"] > 0


def test_lora_dpo_plans_one_copy_of_the_base():
    """The reference forward reads the same base weights: the DPO step's plan has
    the LoRA language-model step's parameter bytes, and no second base's worth
    of temporaries (the weights dominate this shape)."""
    from jlong.planner.memory import plan

    shape = ["model.hidden_size=512", "model.intermediate_size=2048", "model.num_attention_heads=8",
             "train.batch_size=8", "train.seq_len=32", "mesh.fsdp=8", "lora.rank=4"]
    lm = plan(load_config(None, [*SMALL_MODEL, *shape]), devices=jax.devices())
    dpo = plan(load_config(None, [*SMALL_MODEL, *DPO, *shape]), devices=jax.devices())
    assert dpo.parameters == lm.parameters and dpo.frozen_parameters == lm.frozen_parameters > 0
    assert dpo.temporaries - lm.temporaries < 0.5 * lm.frozen_parameters * 8  # the base's whole bytes


def test_a_set_end_id_other_than_the_pairs_is_refused(tmp_path, preference_file):
    from jlong.errors import JlongError
    from jlong.training.loop import train

    with pytest.raises(JlongError, match="closes each preference document with id"):
        train(_dpo_run(tmp_path, preference_file, "data.eos_id=0"))
