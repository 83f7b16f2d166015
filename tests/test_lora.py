"""LoRA and QLoRA runs: the adapters train the same on every layout as on one
device, the frozen base never changes and has no optimizer state, a QLoRA
base computes exactly as its dequantized weights, and a LoRA run resumes
exactly from checkpoints that hold its adapters alone."""

import jax
import numpy as np
import pytest
from helpers import MESH, SMALL_MODEL, assert_same_result, run_config

from jlong.checkpoint import Checkpoints
from jlong.config import load_config
from jlong.data.sources import Batches
from jlong.errors import JlongError
from jlong.lora import nf4
from jlong.parallel.placement import make_mesh
from jlong.program.train_program import TrainProgram
from jlong.training.loop import train

LORA = ["lora.rank=4", "lora.alpha=8"]


def _nonzero_b(params: dict) -> dict:
    """Adapters whose B is random (at the start it is zero, and so would be every A's gradient)."""
    layers = dict(params["layers"])
    keys = iter(jax.random.split(jax.random.key(7), len(layers)))
    for name, w in sorted(layers.items()):
        if name.endswith("_lora_b"):
            layers[name] = (0.05 * jax.random.normal(next(keys), w.shape)).astype(w.dtype)
    return {**params, "layers": layers}


def lora_loss_and_grads(config, devices, adjust=None):
    """Loss and the adapters' gradients of step 1's batch (from seed-0 parameters changed by `adjust(params)`
    first, if given), as numpy; the base is not differentiated."""
    program = TrainProgram(config, make_mesh(config.mesh, devices))
    params = program.init_params(seed=0)
    params = _nonzero_b(adjust(params) if adjust else params)
    batch = program.place_batch(Batches.from_config(config).batch(1))
    frozen = program.frozen_base

    def loss(adapters, base, batch):
        return program.loss(frozen.join(base, adapters), batch)

    value, grads = jax.jit(jax.value_and_grad(loss))(program.saved(params), frozen.frozen(params), batch)
    return float(value), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def one_device():
    return {family: lora_loss_and_grads(load_config(None, [*SMALL_MODEL, *LORA, *extra]), jax.devices()[:1])
            for family, extra in FAMILIES.items()}


FAMILIES = {"llama": [], "qwen3.5": ["model.preset=tiny-qwen3.5", "model.num_hidden_layers=2", "model.full_attention_interval=2"]}
LAYOUTS = {
    "ulysses-upipe-fsdp2-sp4": ["mesh.fsdp=2", "mesh.sp=4", "attention.heads_per_stage=4"],
    "ring2-sp2-fsdp2": ["mesh.ring=2", "mesh.sp=2", "mesh.fsdp=2"],
    "allgather-fsdp2-sp4": ["mesh.fsdp=2", "mesh.sp=4", "attention.sp_method=allgather"],
}


# CI runs UPipe (the most head bookkeeping) and the ring; all-gather is the long tier's (a sharded
# compile of its own, over a minute of CI's 2 cores, for a path the ring and Ulysses already cover).
@pytest.mark.parametrize("family, layout", [
    ("llama", "ulysses-upipe-fsdp2-sp4"),
    ("llama", "ring2-sp2-fsdp2"),
    pytest.param("llama", "allgather-fsdp2-sp4", marks=pytest.mark.slow),
    ("qwen3.5", "ulysses-upipe-fsdp2-sp4"),
])
def test_lora_on_a_layout_equals_one_device(family, layout, one_device):
    """Loss and every adapter's gradient equal the one-device LoRA run's (rtol
    1e-5); Qwen3.5's adapters include its Gated DeltaNet projections."""
    config = load_config(None, [*SMALL_MODEL, *LORA, *FAMILIES[family], *LAYOUTS[layout]])
    got = lora_loss_and_grads(config, jax.devices())
    assert set(got[1]["layers"]) == set(one_device[family][1]["layers"])
    assert_same_result(got, one_device[family])


def test_training_leaves_the_base_unchanged_and_keeps_state_for_the_adapters_alone():
    config = load_config(None, [*SMALL_MODEL, *LORA, *MESH])
    program = TrainProgram(config, make_mesh(config.mesh))
    params = program.init_params(seed=0)
    base_before = jax.tree.map(np.asarray, program.frozen_base.frozen(params))
    opt_state = program.init_opt_state(params)
    batches = Batches.from_config(config)
    for step in (1, 2, 3):
        params, opt_state, metrics = program.step(params, opt_state, program.place_batch(batches.batch(step)))
    base_after = jax.tree.map(np.asarray, program.frozen_base.frozen(params))
    assert jax.tree.all(jax.tree.map(np.array_equal, base_after, base_before))  # bit for bit
    adapters = program.saved(params)
    assert any(np.abs(np.asarray(w)).max() > 0 for name, w in adapters["layers"].items() if name.endswith("_lora_b"))
    adapter_values = sum(w.size for w in jax.tree.leaves(adapters))
    state_values = sum(x.size for x in jax.tree.leaves(opt_state))
    model_values = sum(w.size for w in jax.tree.leaves(params))
    assert 2 * adapter_values <= state_values <= 2 * adapter_values + 8  # two moments, and step counters
    assert state_values < 0.2 * model_values


def test_a_qlora_base_computes_as_its_dequantized_weights():
    """The 4-bit base's forward equals the same model run with the dequantized
    weights: the step adds no error to the quantization's. The quantization
    error itself is NF4's: small against the weights, not zero."""
    config = load_config(None, [*SMALL_MODEL, *LORA, "lora.base_dtype=nf4"])
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    qlora = TrainProgram(config, mesh)
    params = _nonzero_b(qlora.init_params(seed=0))
    quantized = [name for name, w in params["layers"].items() if nf4.is_quantized(w)]
    assert set(quantized) == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    plain = TrainProgram(load_config(None, [*SMALL_MODEL, *LORA]), mesh)
    dequantized = {**params, "layers": {name: nf4.dequantize(w, np.float32) if nf4.is_quantized(w) else w
                                        for name, w in params["layers"].items()}}
    tokens = np.arange(64)[None] % 128
    np.testing.assert_allclose(np.asarray(qlora.bind(params)(tokens)), np.asarray(plain.bind(dequantized)(tokens)),
                               rtol=1e-6, atol=1e-6)
    full = plain.init_params(seed=0)["layers"]["w_gate"]
    error = np.abs(np.asarray(dequantized["layers"]["w_gate"]) - np.asarray(full))
    assert 0 < error.max() < 0.2 * np.abs(np.asarray(full)).max()


def test_a_lora_run_resumes_exactly_and_refuses_another_rank(tmp_path):
    """Stopped at step 2 and resumed, a LoRA run's losses are the uninterrupted
    run's; its checkpoints hold the adapters alone; a run of another rank
    pointed at them is refused in one line."""
    lora = [*LORA, "train.steps=4", "checkpoint.every=2"]
    whole = [r["loss"] for r in train(run_config(tmp_path / "whole", *lora))]
    config = run_config(tmp_path / "parts", *lora)
    first = [r["loss"] for r in train(config, until_step=2)]
    rest = [r["loss"] for r in train(config)]
    assert first + rest == whole
    program = TrainProgram(config, make_mesh(config.mesh))
    checkpoints = Checkpoints(tmp_path / "parts" / "ckpt")
    try:
        assert checkpoints.meta(4)["lora"]["rank"] == 4
        checkpoints.check_layout(4, {"params": program.abstract_saved_params}, "")  # the adapters, nothing else
        with pytest.raises(JlongError, match="holds params of another layout"):
            checkpoints.check_layout(4, {"params": program.abstract_params}, "")
    finally:
        checkpoints.close()
    other = run_config(tmp_path / "parts", "lora.rank=8", "lora.alpha=8", "train.steps=6", "checkpoint.every=2")
    with pytest.raises(JlongError, match="belongs to a different configuration: lora.rank changed"):
        train(other)


@pytest.mark.parametrize("preset", ["tiny-gemma3", pytest.param("tiny-gpt-oss", marks=pytest.mark.slow)])
def test_every_family_trains_its_adapters(preset):
    """LoRA on the families the layouts above do not run (Llama, Qwen3.5) and
    PEFT's parity does not (tests/test_lora_peft.py): the loss falls on a
    repeated batch; GPT-OSS's routed experts get no adapters (all-linear
    leaves them, as PEFT's does), Gemma's MLP does."""
    config = load_config(None, [*SMALL_MODEL, *LORA, f"model.preset={preset}", "model.vocab_size=128",
                                "train.lr=1e-2", "train.warmup_steps=0", "train.batch_size=2"])
    program = TrainProgram(config, make_mesh(config.mesh, jax.devices()[:1]))
    params = program.init_params(seed=0)
    names = set(program.saved(params)["layers"])
    assert not any(name.startswith("expert_") for name in names)
    assert ("w_gate_lora_a" in names) == (preset == "tiny-gemma3")
    opt_state = program.init_opt_state(params)
    batch = program.place_batch(Batches.from_config(config).batch(1))
    losses = []
    for _ in range(3):
        params, opt_state, metrics = program.step(params, opt_state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses


@pytest.mark.fast
def test_a_config_without_lora_reads_back_without_it():
    """config_to_dict and back (staged runs, maxlen's search, run records): no LoRA stays no LoRA."""
    from jlong.config import config_to_dict
    from jlong.config.loading import config_from_dict

    plain = load_config(None, SMALL_MODEL)
    assert config_from_dict(config_to_dict(plain)).lora is None
    adapted = load_config(None, [*SMALL_MODEL, *LORA])
    assert config_from_dict(config_to_dict(adapted)).lora == adapted.lora


@pytest.mark.fast
def test_lora_from_a_jlong_checkpoint_names_the_route_that_works():
    """train.init_from is not a LoRA base; the refusal says how to adapt a model jlong trained."""
    with pytest.raises(JlongError) as refused:
        load_config(None, [*SMALL_MODEL, *LORA, "train.init_from=runs/long/checkpoints"])
    assert str(refused.value).endswith("To adapt a model jlong trained, convert its checkpoint to a Hugging Face "
                                       "directory ('jlong convert CHECKPOINT_DIR HF_DIR') and set "
                                       "model.hf_path=HF_DIR in place of train.init_from")


def test_a_qlora_run_trains_through_the_compiled_step(tmp_path):
    """`jlong train`'s path (the step compiled ahead of time, then run on the
    arrays init made): the 4-bit codes travel packed two to a byte."""
    records = train(run_config(tmp_path, *LORA, "lora.base_dtype=nf4", "train.steps=2", "checkpoint.dir=null"))
    assert len(records) == 2 and all(np.isfinite(r["loss"]) for r in records)


@pytest.mark.fast
@pytest.mark.parametrize("inputs, in_shape, out_shape", [
    (2, (3, 4), (32,)),   # an output projection of three heads: narrow in, one joined product
    (1, (32,), (3, 4)),   # an input projection: wide in, two products
])
def test_an_adapted_weight_computes_its_merged_weight_and_its_adapters_gradients(inputs, in_shape, out_shape):
    """x @ Adapted(w, a, b) = x @ (w + a b) in both of matmul's forms, and so do the gradients of a and b."""
    from jlong.ops.adapted import Adapted, matmul

    rng = np.random.default_rng(0)
    x, w, a, b = (jax.numpy.asarray(rng.standard_normal(shape), jax.numpy.float32) for shape in
                  [(2, 5, *in_shape), (*in_shape, *out_shape), (*in_shape, 4), (4, *out_shape)])

    def adapted(a, b):
        return jax.numpy.sum(jax.numpy.sin(matmul(x, Adapted(w, a, b, inputs), inputs)))

    def merged(a, b):
        return jax.numpy.sum(jax.numpy.sin(jax.numpy.tensordot(x, w + jax.numpy.tensordot(a, b, axes=1), inputs)))

    got, want = jax.value_and_grad(adapted, (0, 1))(a, b), jax.value_and_grad(merged, (0, 1))(a, b)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for g, m in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(m), rtol=1e-4, atol=1e-4)
