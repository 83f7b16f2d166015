"""GRPO (`train.objective: grpo`): one step on a fixed rollouts file logs
TRL's loss, computed apart in float64 from the whole logits of each
completion (transformers' model in double), for every loss type, with the
gradients; the same losses and gradient norms on the training meshes; the
loss function itself against TRL's formula with a KL term; advantages that
vanish for a group of equal rewards; bad input refused in one line."""

import json

import jax
import numpy as np
import pytest
import torch
from helpers import assert_one_line_error, run_cli
from hf_models import small_hf_model

from jlong.config import load_config
from jlong.hf import hf_tensors
from jlong.objectives.grpo import GroupBatches
from jlong.objectives.rollouts import advantages
from jlong.parallel.placement import make_mesh
from jlong.program.train_program import TrainProgram

TEMPERATURE, EPSILON, EPSILON_HIGH, MAX_NEW = 0.7, 0.2, 0.28, 8
GROUPS, PROMPTS = 3, 2


def _rollouts(hf_model, path, *, seed=0, prompt_lengths=(12, 20), vocab=96):
    """A rollouts file: PROMPTS prompts x GROUPS completions, with old log-probabilities that are the model's
    at TEMPERATURE moved by noise (so that ratios leave [1 - eps, 1 + eps_high] both ways), rewards at random."""
    rng = np.random.default_rng(seed)
    records = []
    for group, length in enumerate(prompt_lengths):
        prompt = rng.integers(0, vocab, length).tolist()
        for _ in range(GROUPS):
            completion = rng.integers(0, vocab, int(rng.integers(1, MAX_NEW + 1))).tolist()
            logps = _torch_logps(hf_model, prompt, completion).detach().numpy()
            records.append({"prompt_ids": prompt, "completion_ids": completion, "group": group,
                            "logprobs": (logps + rng.normal(0, 0.4, len(logps))).tolist(),
                            "reward": float(rng.integers(0, 3))})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def _torch_logps(model, prompt, completion):
    logits = model(torch.tensor([prompt + completion])).logits[0].double()
    scaled = logits[len(prompt) - 1:len(prompt) - 1 + len(completion)] / TEMPERATURE
    return torch.log_softmax(scaled, -1)[torch.arange(len(completion)), torch.tensor(completion)]


def trl_loss(model, records, loss_type, beta=0.0, reference=None):
    """TRL's GRPO loss (trl 1.x `_compute_loss` on one process, one micro-batch) in float64."""
    rewards = torch.tensor([r["reward"] for r in records], dtype=torch.float64).reshape(-1, GROUPS)
    advantage = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).reshape(-1)
    per_completion = []
    for record, a in zip(records, advantage):
        logp = _torch_logps(model, record["prompt_ids"], record["completion_ids"])
        ratio = torch.exp(logp - torch.tensor(record["logprobs"], dtype=torch.float64))
        loss = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - EPSILON, 1 + EPSILON_HIGH) * a)
        if beta:
            delta = reference(record) - logp
            loss = loss + beta * (torch.exp(delta) - delta - 1)
        per_completion.append(loss)
    if loss_type == "grpo":
        return torch.stack([t.sum() / len(t) for t in per_completion]).mean()
    total = torch.cat(per_completion).sum()
    if loss_type == "dr_grpo":
        return total / (len(records) * MAX_NEW)
    return total / sum(len(t) for t in per_completion)  # dapo, bnpo


def _config(path, rollouts, *overrides, batch=4):
    return load_config(None, [
        f"model.hf_path={path}", "train.seq_len=64", f"train.batch_size={batch}", "train.compute_dtype=float32",
        "attention.block_size=16", "train.objective=grpo", f"rl.rollouts={rollouts}", f"rl.num_generations={GROUPS}",
        f"rl.prompts_per_step={PROMPTS}", f"rl.max_new_tokens={MAX_NEW}", f"rl.temperature={TEMPERATURE}",
        f"rl.epsilon={EPSILON}", f"rl.epsilon_high={EPSILON_HIGH}", "attention.max_documents=4", *overrides])


def _step_loss_and_grads(config, devices=None):
    """The step's loss, the gradients of what it trains (a LoRA run's adapters alone, as its step), metrics."""
    program = TrainProgram(config, make_mesh(config.mesh, devices or jax.devices()[:config.mesh.size]))
    params = program.starting_params()
    batch = program.place_batch(GroupBatches(config).batch(1, program, params))

    def loss(trained, frozen):
        return program._loss_and_metrics(program.with_saved(frozen, trained) if program.lora else trained, batch)

    (value, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(program.saved(params), params)
    return program, float(value), jax.tree.map(np.asarray, grads), {k: float(v) for k, v in metrics.items()}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    model = small_hf_model("llama")
    model.save_pretrained(tmp / "hf")
    records = _rollouts(model, tmp / "rollouts.jsonl")
    return model.double(), tmp, records


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_one_step_logs_trls_loss_and_its_gradients(loss_type, llama):
    hf_model, tmp, records = llama
    config = _config(tmp / "hf", tmp / "rollouts.jsonl", f"rl.loss_type={loss_type}")
    program, loss, grads, metrics = _step_loss_and_grads(config, jax.devices()[:1])
    hf_model.zero_grad()
    want = trl_loss(hf_model, records, loss_type)
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5, atol=1e-7)
    assert 0 < metrics["clip_ratio/region_mean"] < 1  # the ratios leave the clip range, and not everywhere
    got = hf_tensors(program.bind(grads))
    for name, parameter in hf_model.named_parameters():
        expected = parameter.grad.numpy()
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(), err_msg=name)


@pytest.mark.fast
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_the_loss_with_a_kl_term_is_trls_formula(loss_type):
    """grpo_loss on packed rows (two completions in one row, one in another, a token outside any) against
    TRL's formula in float64, beta > 0 against a reference, with TRL's clip and KL metrics."""
    from jlong.objectives.grpo import LossSettings, grpo_loss

    rng = np.random.default_rng(3)
    B, S = 2, 10
    documents = np.full((B, S), -1, np.int32)
    documents[0, 1:4], documents[0, 5:9], documents[1, 2:7] = 0, 1, 0
    mask = documents >= 0
    logp, old, ref = (rng.normal(-2, 0.5, (B, S)) for _ in range(3))
    advantage = np.zeros((B, S))
    advantage[0, 1:4], advantage[0, 5:9], advantage[1, 2:7] = 0.8, -1.1, 0.3
    batch = {"loss_mask": mask, "old_logps": old.astype(np.float32), "advantages": advantage.astype(np.float32),
             "documents": documents}
    settings = LossSettings(loss_type, 0.2, 0.28, 0.05, completions=3, max_completion_length=6, documents=4)
    loss, metrics = grpo_loss(logp.astype(np.float32), np.ones((B, S), np.float32), batch, settings,
                              ref.astype(np.float32))
    ratio = np.exp(logp - old)
    per_token = -np.minimum(ratio * advantage, np.clip(ratio, 0.8, 1.28) * advantage)
    per_token += 0.05 * (np.exp(ref - logp) - (ref - logp) - 1)
    completions = [per_token[0, 1:4], per_token[0, 5:9], per_token[1, 2:7]]
    want = {"grpo": np.mean([c.mean() for c in completions]), "dr_grpo": sum(c.sum() for c in completions) / (3 * 6),
            "dapo": per_token[mask].mean(), "bnpo": per_token[mask].mean()}[loss_type]
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    low, high = (ratio < 0.8) & (advantage < 0), (ratio > 1.28) & (advantage > 0)
    np.testing.assert_allclose(float(metrics["clip_ratio/low_mean"]), low[mask].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["clip_ratio/high_mean"]), high[mask].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["kl"]), (np.exp(ref - logp) - (ref - logp) - 1)[mask].mean(), rtol=1e-5)


@pytest.mark.fast
def test_a_group_of_equal_rewards_has_no_advantage_and_the_others_trls():
    rewards = np.array([1.0, 1.0, 1.0, 0.0, 2.0, 1.0])
    got = advantages(rewards, 3, "group")
    np.testing.assert_array_equal(got[:3], 0.0)
    np.testing.assert_allclose(got[3:], (rewards[3:] - 1.0) / (1.0 + 1e-4))
    np.testing.assert_allclose(advantages(rewards, 3, "none")[3:], rewards[3:] - 1.0)
    np.testing.assert_allclose(advantages(rewards, 3, "batch"), (rewards - np.repeat([1.0, 1.0], 3))
                               / (rewards.std(ddof=1) + 1e-4))


@pytest.mark.fast
def test_the_rows_hold_whole_documents_and_only_completions_carry_loss():
    from jlong.objectives.rollouts import Rollouts, rows

    rollouts = Rollouts(2, [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]], [[9, 8], [7], [6, 6, 6], [5]],
                        [[-0.1, -0.2], [-0.3], [-0.4, -0.5, -0.6], [-0.7]], np.zeros((4, 1)), ["r"],
                        np.array([1.0, 0.0, 1.0, 1.0]), np.array([True, False, True, True]), [0, 0, 1, 1])
    arrays = rows(rollouts, np.array([0.5, -0.5, 0.25, 0.75]), seq_len=8, batch_size=2, max_documents=4,
                  mask_truncated=True)
    # Rows of 8 inputs hold 9 tokens: [1 2 3 9 8 | 1 2 3 7] and [4 5 6 6 6 | 4 5 5], first fit in order.
    np.testing.assert_array_equal(arrays["inputs"], [[1, 2, 3, 9, 8, 1, 2, 3], [4, 5, 6, 6, 6, 4, 5, 5]])
    np.testing.assert_array_equal(arrays["targets"], [[2, 3, 9, 8, 1, 2, 3, 7], [5, 6, 6, 6, 4, 5, 5, 0]])
    np.testing.assert_array_equal(arrays["segment_ids"], [[0] * 5 + [1] * 3, [0] * 5 + [1] * 3])
    np.testing.assert_array_equal(arrays["positions"], [[0, 1, 2, 3, 4, 0, 1, 2]] * 2)
    # Completion targets only; the second completion has no stop id, and mask_truncated takes its loss away.
    np.testing.assert_array_equal(arrays["loss_mask"], [[0, 0, 1, 1, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0, 1, 0]])
    np.testing.assert_array_equal(arrays["documents"], [[-1, -1, 0, 0, -1, -1, -1, 1], [-1, 0, 0, 0, -1, -1, 1, -1]])
    np.testing.assert_allclose(arrays["old_logps"][0], [0, 0, -0.1, -0.2, 0, 0, 0, -0.3])
    np.testing.assert_allclose(arrays["advantages"][1], [0, 0.25, 0.25, 0.25, 0, 0, 0.75, 0])


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.fast
@pytest.mark.parametrize("case", ["import", "generations", "group_size", "long_prompt"])
def test_bad_grpo_input_is_one_line_and_writes_nothing(case, tmp_path):
    prompts = _write(tmp_path / "prompts.jsonl", [{"prompt_ids": [1, 2, 3], "answer": "x"}] * 2 + (
        [{"prompt_ids": [5] * 60}] if case == "long_prompt" else []))
    rollouts = _write(tmp_path / "rollouts.jsonl", [{"prompt_ids": [1, 2], "completion_ids": [3], "logprobs": [-1.0],
                                                    "reward": 1.0, "group": 0}] * 2)
    source = {"group_size": f"rl.rollouts={rollouts}"}.get(case, f"rl.prompts={prompts}")
    overrides = ["model.preset=tiny-llama", "train.seq_len=64", "train.batch_size=8", "mesh.fsdp=8",
                 "train.objective=grpo", source, "rl.num_generations=1" if case == "generations" else
                 "rl.num_generations=4", "rl.max_new_tokens=8", f"run_dir={tmp_path / 'run'}",
                 f"checkpoint.dir={tmp_path / 'ckpt'}",
                 "rl.rewards=[no_such_module_here:score]" if case == "import" else "rl.rewards=[exact_answer]"]
    config = tmp_path / "grpo.yaml"
    config.write_text("{}\n")
    result = run_cli("train", config, *overrides)
    message = {
        "import": "rl.rewards entry 'no_such_module_here:score' cannot be imported (ModuleNotFoundError",
        "generations": "rl.num_generations must be at least 2",
        "group_size": "rl.rollouts group 0 has 2 completions; rl.num_generations is 4",
        "long_prompt": "rl.prompts: prompt 2 has 60 tokens, more than train.seq_len - rl.max_new_tokens (56)",
    }[case]
    assert_one_line_error(result, message)
    assert not (tmp_path / "run").exists() and not (tmp_path / "ckpt").exists()


LAYOUTS = {
    "fsdp8": ["mesh.fsdp=8"],
    "sp4-fsdp2": ["mesh.sp=4", "mesh.fsdp=2", "attention.heads_per_stage=4"],
    "ring2-sp2-fsdp2": ["mesh.ring=2", "mesh.sp=2", "mesh.fsdp=2"],
}
LORA = ["lora.rank=4", "lora.alpha=8"]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """name -> (its config's overrides: an HF checkpoint and a rollouts file of prompts longer than a
    shard, 24 and 40 tokens), made on first use."""
    made = {}

    def get(name):
        family = name.removesuffix("-lora")
        if family not in made:
            tmp = tmp_path_factory.mktemp(family)
            model = small_hf_model(family)
            model.save_pretrained(tmp / "hf")
            _rollouts(model, tmp / "rollouts.jsonl", prompt_lengths=(24, 40))
            made[family] = tmp
        return made[family]

    return get


def _loss_and_norm(name, tmp, *layout):
    config = _config(tmp / "hf", tmp / "rollouts.jsonl", "rl.beta=0.04" if "lora" in name else "rl.beta=0",
                     *(LORA if "lora" in name else ()), *layout, batch=8)
    _, loss, grads, _ = _step_loss_and_grads(config, None if layout else jax.devices()[:1])
    return loss, float(np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in jax.tree.leaves(grads))))


@pytest.mark.parametrize("name, layout", [
    ("llama", "fsdp8"), ("llama", "sp4-fsdp2"), ("qwen3.5", "ring2-sp2-fsdp2"), ("llama-lora", "ring2-sp2-fsdp2"),
    pytest.param("llama", "ring2-sp2-fsdp2", marks=pytest.mark.slow),
    pytest.param("qwen3.5", "sp4-fsdp2", marks=pytest.mark.slow),
    pytest.param("qwen3.5", "fsdp8", marks=pytest.mark.slow),
    pytest.param("qwen3.5-lora", "sp4-fsdp2", marks=pytest.mark.slow),
])
def test_every_layout_has_one_devices_loss_and_gradient_norm(name, layout, families):
    """The loss (near zero: the advantages are zero-mean per group) compared absolutely; LoRA with a KL term
    against its base, the adapters off (they start at zero, so one PEFT-like perturbation is not needed: the
    ratio's clip and the advantages carry the gradient)."""
    tmp = families(name)
    loss, norm = _loss_and_norm(name, tmp, *LAYOUTS[layout])
    want_loss, want_norm = _loss_and_norm(name, tmp)
    np.testing.assert_allclose(loss, want_loss, rtol=0, atol=1e-6)
    np.testing.assert_allclose(norm, want_norm, rtol=1e-5)
    assert norm > 0


REWARD_FILE = '''
def share_of_a(prompts, completions, completion_ids, **columns):
    return [sum(i == 97 for i in ids) / max(len(ids), 1) for ids in completion_ids]


def breaks_on_the_second_batch(prompts, completions, completion_ids, answer, **columns):
    if "boom" in answer:
        raise RuntimeError("cannot score this")
    return [0.5] * len(completion_ids)
'''


def _sampled_run(tmp_path, *overrides, reward="share_of_a"):
    """A tiny byte-level model trained by GRPO from jlong's sampler: 8 completions of each of 2 prompts a step."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    _write(tmp_path / "prompts.jsonl", [{"prompt": f"say a {i}:", "answer": "boom" if i >= 2 else "ok"}
                                        for i in range(8)])
    return load_config(None, [
        "model.preset=tiny-llama", "mesh.fsdp=8", "attention.block_size=16", "train.seq_len=32",
        "train.batch_size=8", "train.lr=1e-2", "train.warmup_steps=1", "train.compute_dtype=float32",
        "train.objective=grpo", f"rl.prompts={tmp_path / 'prompts.jsonl'}",
        f"rl.rewards=[{tmp_path / 'rewards.py'}:{reward}]", "rl.num_generations=8", "rl.prompts_per_step=2",
        "rl.max_new_tokens=8", f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}", *overrides])


def test_the_samplers_rollouts_raise_a_tiny_models_reward(tmp_path):
    """From random weights no completion holds an 'a' at first: every group's rewards are equal, no advantage, no
    gradient; then the reward of 'a's rises (0.0 -> 0.48 in 12 steps when this was written). Every key of the
    records is declared (TRL's names)."""
    from jlong.api import train
    from jlong.training.metric_names import undeclared

    records = train(_sampled_run(tmp_path, "train.steps=12"))
    first = records[0]
    assert first["frac_reward_zero_std"] == 1.0 and first["grad_norm"] == 0.0 and first["loss"] == 0.0
    assert np.mean([r["reward"] for r in records[-3:]]) > np.mean([r["reward"] for r in records[:3]]) + 0.2
    assert [name for record in records for name in undeclared(record)] == []
    assert {"rewards/share_of_a/mean", "completions/clipped_ratio", "clip_ratio/region_mean", "entropy",
            "sampler_tokens_per_s"} <= set(first)


def test_a_resumed_run_continues_as_an_uninterrupted_one(tmp_path):
    """Stopped after step 3, in the middle of a batch of rollouts that serves two steps (rl.num_iterations=2):
    the resumed step 4 trains on that batch and logs what the uninterrupted run's step 4 logs."""
    from jlong.api import train

    whole = train(_sampled_run(tmp_path / "whole", "train.steps=4", "rl.num_iterations=2"))
    config = _sampled_run(tmp_path / "parts", "train.steps=4", "rl.num_iterations=2", "checkpoint.every=1")
    assert [r["step"] for r in train(config, until_step=3)] == [1, 2, 3]
    resumed = train(config)
    assert [r["step"] for r in resumed] == [4]
    for key in ("loss", "grad_norm", "reward", "entropy", "num_tokens", "completions/mean_length"):
        np.testing.assert_allclose(resumed[0][key], whole[3][key], rtol=1e-6, atol=1e-9, err_msg=key)


def test_a_reward_function_that_raises_stops_the_run_naming_it(tmp_path):
    """The second step's prompts make the function raise: the run stops in one line naming it, the step is not
    taken, the first step's checkpoint stays the newest and intact."""
    import yaml
    from helpers import logged_losses

    from jlong.checkpoint import Checkpoints
    from jlong.config import config_to_dict

    config = tmp_path / "grpo.yaml"
    overrides = ["train.steps=3", "checkpoint.every=1"]
    config.write_text(yaml.safe_dump(config_to_dict(_sampled_run(tmp_path, reward="breaks_on_the_second_batch"))))
    result = run_cli("train", config, *overrides)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == ("jlong: error: reward function breaks_on_the_second_batch "
                                                      "raised RuntimeError: cannot score this; the step was not taken")
    assert len(logged_losses(tmp_path / "run")) == 1
    saved = Checkpoints(tmp_path / "ckpt")
    assert saved.latest_step() == 1
    saved.close()
    assert run_cli("verify", tmp_path / "ckpt").returncode == 0


def test_the_exported_weights_are_the_runs_own(llama, tmp_path):
    """rl.export_every=1 over a rollouts file: after step 2 the export directory holds what `jlong convert` makes
    of step 2's checkpoint, tensor for tensor, and nothing half written beside it."""
    from safetensors.numpy import load_file

    from jlong.api import train

    _, tmp, _ = llama
    config = _config(tmp / "hf", tmp / "rollouts.jsonl", "train.steps=2", "train.lr=1e-2", "train.warmup_steps=1",
                     "mesh.fsdp=4", "mesh.sp=2", "rl.export_every=1", f"rl.export_dir={tmp_path / 'export'}",
                     f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every=1")
    train(config)
    assert run_cli("convert", tmp_path / "ckpt", tmp_path / "converted").returncode == 0
    exported, converted = (load_file(tmp_path / name / "model.safetensors") for name in ("export", "converted"))
    assert exported.keys() == converted.keys()
    for name, tensor in converted.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "converted", "export"]
