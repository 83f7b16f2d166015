"""LoRA runs and PEFT: jlong's adapted model computes what peft + transformers
compute from the same adapters (logits and the adapters' gradients, float32),
starts as its base, reads a PEFT adapter directory (`lora.init_from`) and
writes one (`jlong convert`), or its base with the adapters merged
(`jlong convert --merge`).

Which modules a run adapts: jlong's all-linear is every attention, Gated
DeltaNet and dense (or shared-expert) MLP projection; PEFT is given exactly
those (`target_modules`, short names). PEFT's own "all-linear" takes more in
the mixtures, on transformers 5 and peft 0.21:
- Qwen3.5-MoE: also `mlp.shared_expert_gate` (an nn.Linear to one output).
  Its router (`mlp.gate`, a module of its own) and its routed experts
  (fused 3-D parameters) are not nn.Linear, and neither adapts them.
- Qwen3-MoE: also its experts' fused parameters and its router's weight,
  as `target_parameters` (PEFT reads the names gate_proj, up_proj,
  down_proj and gate as the experts and router of transformers 4), and for
  the same reason not the MLP of its dense layers (`mlp_only_layers`),
  which jlong adapts: the mixture checked against PEFT is Qwen3.5-MoE, and
  `test_peft_takes_a_qwen3_moe_dense_mlp_for_its_experts` keeps the note
  that `jlong convert` prints about it true.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import yaml
from helpers import SMALL_MODEL, assert_one_line_error, run_cli
from hf_models import small_hf_model

from jlong.checkpoint import Checkpoints
from jlong.config import config_to_dict, load_config
from jlong.errors import JlongError
from jlong.hf import model_config_from_hf
from jlong.lora.peft_format import adapter_shapes, peft_caveat, peft_tensors, read_adapters, write_adapters
from jlong.lora.targets import hf_modules, lora_settings
from jlong.parallel.placement import make_mesh
from jlong.program.train_program import TrainProgram
from jlong.training.loop import start, train

RANK, ALPHA = 4, 8
HYBRID = {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
FAMILIES = {"qwen3": {}, "qwen3.5": HYBRID, "qwen3.5-moe": HYBRID}
GRADIENTS = ("qwen3", "qwen3.5-moe")  # the families whose adapters' gradients are compared (each a long compile)
TOKENS = np.random.default_rng(1).integers(0, 96, (2, 24))
LABELS = np.random.default_rng(2).integers(0, 96, (2, 24))


def _config(hf_path, *overrides):
    return load_config(None, [
        f"model.hf_path={hf_path}", "train.seq_len=32", "train.batch_size=2", "train.compute_dtype=float32",
        "data.source=synthetic", f"lora.rank={RANK}", f"lora.alpha={ALPHA}", *overrides])


def _without_lora(config) -> dict:
    """The config's dict without its lora section: the same model, every parameter its own."""
    return {key: value for key, value in config_to_dict(config).items() if key != "lora"}


def _one_device(config) -> TrainProgram:
    one = load_config(None, ["mesh.fsdp=1", "mesh.ring=1", "mesh.sp=1"], base=config_to_dict(config))
    return TrainProgram(one, make_mesh(one.mesh, jax.devices()[:1]))


def _short_names(model, lora) -> list[str]:
    modules = hf_modules(model)
    return sorted({modules[name].rsplit(".", 1)[-1] for name in lora.targets})


def _peft_model(hf_model, targets, seed=3):
    """`hf_model` (changed in place) with PEFT's adapters on `targets`, A and B random."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(hf_model, config)
    with torch.no_grad():  # B well away from zero, so that the adapters change the logits clearly
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3)
    return model.eval()


def _nll(logits, labels):
    """The summed negative log-likelihood of `labels`."""
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1).sum()


def _peft_state(model) -> dict[str, np.ndarray]:
    """The PEFT model's adapter weights, by the names PEFT saves them under."""
    return {name.replace(".default.", "."): p.detach().numpy() for name, p in model.named_parameters()
            if "lora_" in name}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """A small HF model with random PEFT adapters on jlong's all-linear targets, saved (base and adapters), the
    one-device jlong program of a LoRA run on it, and its `step`: params -> (summed NLL of LABELS, logits of
    TOKENS, the NLL's gradient with respect to the adapters) (with GRADIENTS; else logits alone and None)."""
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    hf_model = small_hf_model(name, **FAMILIES[name])
    hf_model.save_pretrained(tmp / "hf")
    with torch.no_grad():
        base_logits = hf_model(torch.as_tensor(TOKENS)).logits.numpy()
    program = _one_device(_config(tmp / "hf"))
    peft_model = _peft_model(hf_model, _short_names(program.config.model, program.lora))
    peft_model.save_pretrained(tmp / "adapter")

    def nll(adapters, frozen, tokens, labels):
        logits = program.bind(program.with_saved(frozen, adapters))(tokens)
        return _nll(logits, labels), logits

    compiled = jax.jit(jax.value_and_grad(nll, has_aux=True) if name in GRADIENTS else nll)

    def step(params):
        result = compiled(program.saved(params), program.frozen_base.frozen(params), jnp.asarray(TOKENS),
                          jnp.asarray(LABELS))
        (loss, logits), grads = result if name in GRADIENTS else (result, None)
        return loss, logits, grads

    return dict(name=name, path=tmp, program=program, peft=peft_model, base_logits=base_logits, step=step)


def test_logits_and_adapter_gradients_equal_peft(family):
    """Logits for every family; the adapters' gradients for those of GRADIENTS (Qwen3.5's layers are
    Qwen3.5-MoE's: their gradients are checked there)."""
    program, peft_model = family["program"], family["peft"]
    adapters = read_adapters(family["path"] / "adapter", program)
    # The reader's layout is the writer's inverse: PEFT's saved tensors come back exactly.
    saved = _peft_state(peft_model)
    written = peft_tensors(adapters["layers"], program.config.model, program.lora)
    assert written.keys() == saved.keys()
    for key, value in written.items():
        np.testing.assert_array_equal(value, saved[key], err_msg=key)

    params = program.with_saved(program.load_hf_params(family["path"] / "hf"), program.place_saved(adapters))
    loss, logits, grads = family["step"](params)
    peft_model.zero_grad()
    want = peft_model(torch.as_tensor(TOKENS)).logits
    want_loss = torch.nn.functional.cross_entropy(want.reshape(-1, want.shape[-1]),
                                                  torch.as_tensor(LABELS).reshape(-1), reduction="sum")
    np.testing.assert_allclose(np.asarray(logits), want.detach().numpy(), rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(logits) - family["base_logits"]).max() > 0.05  # the adapters matter
    np.testing.assert_allclose(float(loss), want_loss.item(), rtol=1e-5)
    if grads is None:
        return

    want_loss.backward()
    want_grads = {name.replace(".default.", "."): p.grad.numpy() for name, p in peft_model.named_parameters()
                  if "lora_" in name}
    grads = peft_tensors(jax.tree.map(np.asarray, grads)["layers"], program.config.model, program.lora)
    assert grads.keys() == want_grads.keys()
    for key, grad in grads.items():
        scale = np.abs(want_grads[key]).max()
        assert scale > 0, key
        np.testing.assert_allclose(grad, want_grads[key], rtol=1e-4, atol=1e-4 * scale, err_msg=key)


@pytest.mark.parametrize("family", GRADIENTS, indirect=True)  # Qwen3.5's layers are Qwen3.5-MoE's
def test_fresh_adapters_leave_the_base_model(family):
    """Exactly, but where a Gated DeltaNet input projection (in_proj_qkv, _z, _b, _a) is adapted: there XLA
    compiles the layer otherwise and its logits differ from the base's in rounding (1.5e-7 of 0.6 on the CPU)."""
    program = family["program"]
    params = program.load_hf_params(family["path"] / "hf", seed=5)
    adapters = program.saved(params)["layers"]
    assert all(not np.any(np.asarray(b)) for name, b in adapters.items() if name.endswith("_lora_b"))
    assert all(np.any(np.asarray(a)) for name, a in adapters.items() if name.endswith("_lora_a"))
    base = _one_device(load_config(None, [], base=_without_lora(program.config)))
    assert base.lora is None
    base_logits = jax.jit(lambda p, t: base.bind(p)(t))(base.load_hf_params(family["path"] / "hf"), TOKENS)
    _, logits, _ = family["step"](params)
    gated_deltanet = {"gdn_qkv", "gdn_z", "gdn_b", "gdn_a"} & set(program.lora.targets)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(base_logits), rtol=0,
                               atol=1e-6 if gated_deltanet else 0)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run of qwen3 on fsdp 2 x sp 4 started from random PEFT adapters (lora.init_from), one step,
    checkpointed at the end; its config and the PEFT model it started from."""
    tmp = tmp_path_factory.mktemp("lora_run")
    hf_model = small_hf_model("qwen3")
    hf_model.save_pretrained(tmp / "hf")
    model = model_config_from_hf(tmp / "hf")
    lora = lora_settings(load_config(None, [f"model.hf_path={tmp / 'hf'}", f"lora.rank={RANK}"]).lora, model)
    peft_model = _peft_model(hf_model, _short_names(model, lora), seed=11)
    peft_model.save_pretrained(tmp / "adapter")
    config = _config(tmp / "hf", "mesh.fsdp=2", "mesh.sp=4", "train.steps=1", "train.warmup_steps=1",
                     "train.lr=1e-2", f"lora.init_from={tmp / 'adapter'}", f"checkpoint.dir={tmp / 'ckpt'}")
    train(config)
    return dict(path=tmp, config=config, peft=peft_model)


def test_a_run_from_a_peft_directory_starts_with_exactly_its_adapters(lora_run):
    config = load_config(None, ["checkpoint.dir=null"], base=config_to_dict(lora_run["config"]))
    run = start(config, make_mesh(config.mesh), None, last=0)
    adapters = jax.tree.map(np.asarray, run.program.saved(run.params))["layers"]
    started = peft_tensors(adapters, config.model, run.program.lora)
    saved = _peft_state(lora_run["peft"])
    assert started.keys() == saved.keys()
    for key, value in started.items():
        np.testing.assert_array_equal(value, saved[key], err_msg=key)


@pytest.mark.fast
def test_a_peft_directory_of_other_settings_is_refused_in_one_line(lora_run, tmp_path):
    hf, adapter = lora_run["path"] / "hf", lora_run["path"] / "adapter"
    refusals = {
        "lora.rank=8": "has rank 4 and alpha 8; this run configures rank 8 and alpha 8: set lora.rank and "
                       "lora.alpha to its",
        "lora.alpha=16": "has rank 4 and alpha 8; this run configures rank 4 and alpha 16",
        "lora.targets=[q_proj,v_proj]": "has a tensor this run does not adapt: base_model.model.model.layers.0."
                                        "mlp.down_proj.lora_A.weight (lora.targets must name the modules it adapts)",
    }
    for override, message in refusals.items():
        program = _one_device(_config(hf, override))
        with pytest.raises(JlongError) as refused:
            read_adapters(adapter, program)
        assert str(refused.value).startswith(f"lora.init_from '{adapter}' {message}")
        assert "\n" not in str(refused.value)
    shutil.copytree(adapter, tmp_path / "dora")
    settings = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**settings, "use_dora": True}))
    with pytest.raises(JlongError, match="holds adapters with DoRA; a run reads PEFT's plain LoRA"):
        read_adapters(tmp_path / "dora", _one_device(lora_run["config"]))


def _trained_logits(lora_run):
    """The logits of the run's last checkpoint, computed by jlong on one device, and its step."""
    program = _one_device(lora_run["config"])
    checkpoints = Checkpoints(lora_run["path"] / "ckpt")
    step = checkpoints.latest_step()
    adapters, _ = checkpoints.restore(step, program.abstract_saved_params)
    checkpoints.close()
    params = program.with_saved(program.load_hf_params(lora_run["path"] / "hf"), adapters)
    return np.asarray(program.bind(params)(jnp.asarray(TOKENS))), step


def test_convert_writes_peft_adapters_and_a_merged_checkpoint_with_the_runs_logits(lora_run, tmp_path):
    import transformers

    want, step = _trained_logits(lora_run)
    ckpt, hf = lora_run["path"] / "ckpt", lora_run["path"] / "hf"
    result = run_cli("convert", ckpt, tmp_path / "adapter")
    assert result.returncode == 0, result.stderr
    assert "a PEFT LoRA adapter directory: adapter_config.json, adapter_model.safetensors" in result.stdout
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "adapter").iterdir()}
    assert modes["adapter_model.safetensors"] == modes["adapter_config.json"], modes  # the umask's, not 0600
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (settings["r"], settings["lora_alpha"], settings["base_model_name_or_path"]) == (RANK, ALPHA, str(hf))
    base = transformers.Qwen3ForCausalLM.from_pretrained(hf).eval()
    before = base(torch.as_tensor(TOKENS)).logits.detach().numpy()
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    got = adapted(torch.as_tensor(TOKENS)).logits.detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.abs(got - before).max() > 0.05

    result = run_cli("convert", ckpt, tmp_path / "merged", "--merge")
    assert result.returncode == 0, result.stderr
    assert "a Hugging Face checkpoint with the LoRA adapters merged: config.json, model.safetensors" in result.stdout
    merged = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(merged(torch.as_tensor(TOKENS)).logits.detach().numpy(), want, rtol=1e-4, atol=1e-4)

    # The run's base gone: --merge has nothing to merge into (the adapters alone still convert).
    shutil.move(hf, lora_run["path"] / "moved")
    try:
        assert_one_line_error(run_cli("convert", ckpt, tmp_path / "again", "--merge"),
                              f"--merge: the base of checkpoint step {step} in '{ckpt}', model.hf_path '{hf}', is not "
                              "a Hugging Face checkpoint (no config.json there)")
    finally:
        shutil.move(lora_run["path"] / "moved", hf)
    assert not (tmp_path / "again").exists()
    assert_one_line_error(run_cli("convert", ckpt, tmp_path / "merged", "--merge"),
                          "already exists and is not an empty directory")
    assert_one_line_error(run_cli("convert", tmp_path / "adapter", tmp_path / "other"),
                          "is neither a Hugging Face checkpoint (config.json) nor a jlong checkpoint directory")
    assert_one_line_error(run_cli("convert", hf, tmp_path / "other", "--merge"),
                          f"--merge merges a LoRA run's adapters into its base; '{hf}' is a Hugging Face checkpoint")


def test_a_changed_base_is_refused_by_a_resume_and_by_merge(lora_run, tmp_path):
    """The run's checkpoints record its base's digest: over a base whose weights changed since, a resume
    and `convert --merge` each stop in one line (exit 2), with nothing written."""
    from safetensors.numpy import load_file, save_file

    ckpt, hf = lora_run["path"] / "ckpt", lora_run["path"] / "hf"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(config_to_dict(lora_run["config"])))
    weights = hf / "model.safetensors"
    original = weights.read_bytes()
    tensors = load_file(str(weights))
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    contents = sorted((str(p.relative_to(ckpt)), p.stat().st_mtime_ns) for p in ckpt.rglob("*"))
    try:
        save_file(tensors, str(weights), metadata={"format": "pt"})
        assert_one_line_error(run_cli("train", config, "train.steps=2"),
                              f"the base model in '{hf}' is not the one checkpoint.dir '{ckpt}' (step 1) adapted: "
                              "its files changed since (digest ")
        assert_one_line_error(run_cli("convert", ckpt, tmp_path / "merged", "--merge"),
                              f"the base model in '{hf}' is not the one checkpoint step 1 in '{ckpt}' adapted")
    finally:
        weights.write_bytes(original)
    assert sorted((str(p.relative_to(ckpt)), p.stat().st_mtime_ns) for p in ckpt.rglob("*")) == contents
    assert not (tmp_path / "merged").exists()


@pytest.mark.fast
def test_merge_needs_the_runs_base(tmp_path):
    """A LoRA run of a random base (no model.hf_path) has nothing to merge into; a run without LoRA has no
    adapters to merge."""
    config = load_config(None, [*SMALL_MODEL, f"lora.rank={RANK}"])
    lora = {**config.lora.model_dump(mode="json"), "hf_path": None}  # as the train loop records it
    adapters = {name: np.ones(shape, np.float32)
                for name, shape in adapter_shapes(config.model, lora_settings(config.lora, config.model)).items()}
    checkpoints = Checkpoints(tmp_path / "lora")
    checkpoints.save(1, {"layers": adapters}, model=config.model, extra={"lora": lora})
    checkpoints.close()
    assert_one_line_error(run_cli("convert", tmp_path / "lora", tmp_path / "out", "--merge"),
                          "--merge: the run of checkpoint step 1 in '" + str(tmp_path / "lora") + "' had no "
                          "model.hf_path, so there is no base to merge its adapters into")
    result = run_cli("convert", tmp_path / "lora", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    checkpoints = Checkpoints(tmp_path / "full")
    checkpoints.save(1, {"embed": np.zeros(3, np.float32)}, model=config.model)
    checkpoints.close()
    assert_one_line_error(run_cli("convert", tmp_path / "full", tmp_path / "none", "--merge"),
                          "holds the whole model of a run without a lora section: convert it without --merge")


@pytest.mark.fast
def test_peft_takes_a_qwen3_moe_dense_mlp_for_its_experts(tmp_path):
    """What `peft_caveat` says, as PEFT does it: the adapters of a Qwen3-MoE's dense MLP (layer 1 here) are
    not loaded; its attention's are."""
    hf_model = small_hf_model("qwen3-moe")
    hf_model.save_pretrained(tmp_path / "hf")
    model = model_config_from_hf(tmp_path / "hf")
    lora = lora_settings(load_config(None, [f"model.hf_path={tmp_path / 'hf'}", f"lora.rank={RANK}"]).lora, model)
    assert {"w_gate", "w_up", "w_down"} <= set(lora.targets)
    assert "gate_proj, up_proj, down_proj of a qwen3_moe model" in peft_caveat(model, lora)
    rng = np.random.default_rng(0)
    adapters = {name: rng.normal(size=shape) for name, shape in adapter_shapes(model, lora).items()}
    write_adapters(tmp_path / "adapter", adapters, model, lora, None)
    adapted = peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapter")
    layer = adapted.base_model.model.model.layers[1]
    assert hasattr(layer.self_attn.q_proj, "lora_A")
    assert not hasattr(layer.mlp.gate_proj, "lora_A")  # when PEFT adapts it, drop peft_caveat's note

