"""Gemma 3 through the family seam: sliding-window attention in every kernel
and layout (Hugging Face's window convention, at the window's edge), the
ring's halo schedule, the all-gather's band on gathered keys, training on
ring x sp x fsdp and on all-gather sp x fsdp equal to one device, its
Hugging Face config forms, and its FLOPs."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_result, loss_and_grads, small_config
from hf_models import hf_logits, small_hf_model
from jax.sharding import AxisType, PartitionSpec

import jlong
from cudnn_emulation import emulate_cudnn
from jlong.attention.blockwise import BlockwiseStep
from jlong.attention.cudnn import CudnnStep, causal_fraction
from jlong.attention.kernels import AttentionKernel, reference_attention
from jlong.attention.ring import ring_attention
from jlong.attention.sliding import gathered_schedule, schedule, sliding_gathered_attention, sliding_ring_attention
from jlong.config import load_config
from jlong.errors import JlongError
from jlong.families import family_of
from jlong.families.base import mean_visible_keys
from jlong.ops.zigzag import chunk_token_index

TINY = ["model.preset=tiny-gemma3", "data.eos_id=7", "model.vocab_size=128", "model.num_hidden_layers=4"]


def _tiny(*overrides):
    return small_config(*TINY, *overrides)


@pytest.mark.parametrize("impl", ["reference", "blockwise", "cudnn"])
def test_a_window_of_w_sees_itself_and_the_w_minus_1_tokens_before_it(impl, monkeypatch):
    """Equal scores make each output the mean of the values it sees: with
    value = position, query p's output is the mean of max(0, p - w + 1)..p,
    Hugging Face's `kv_idx > q_idx - sliding_window`."""
    S, w = 48, 10
    q = jnp.zeros((1, S, 2, 8))
    v = jnp.broadcast_to(jnp.arange(S, dtype=jnp.float32)[None, :, None, None], (1, S, 1, 8))
    if impl == "cudnn":
        emulate_cudnn(monkeypatch)
        out = CudnnStep(max_documents=4).forward(q, v, v, None, True, AttentionKernel(window=w).band)[0]
    else:
        out = AttentionKernel(impl, block_size=8, window=w).local(q, v, v)
    first_seen = np.maximum(np.arange(S) - w + 1, 0)
    np.testing.assert_allclose(np.asarray(out)[0, :, 0, 0], (first_seen + np.arange(S)) / 2, rtol=1e-6)


@pytest.mark.parametrize("window", [1, 7, 8, 9, 64])
def test_windowed_kernels_equal_reference_with_packed_documents(window, monkeypatch):
    """Outputs and gradients of the blockwise kernel (blocks of 8: windows at,
    below and above a block's edge) and cuDNN's code (emulated) against the
    score matrix, with documents that start inside windows."""
    emulate_cudnn(monkeypatch)
    B, S, H, K, d = 2, 40, 4, 2, 8
    keys = jax.random.split(jax.random.PRNGKey(window), 4)
    q = jax.random.normal(keys[0], (B, S, H, d))
    k, v = (jax.random.normal(key, (B, S, K, d)) for key in keys[1:3])
    segments = jnp.asarray(np.cumsum(np.random.default_rng(window).random((B, S)) < 0.08, axis=1), jnp.int32)
    do = jax.random.normal(keys[3], q.shape)
    out, pullback = jax.vjp(lambda q, k, v: reference_attention(q, k, v, segments, window=window), q, k, v)
    want = [out, *pullback(do)]
    band = AttentionKernel(window=window).band
    for step in (BlockwiseStep(8), CudnnStep(max_documents=16)):
        got_out, got_pullback = jax.vjp(
            lambda q, k, v: ring_attention(q, k, v, segments, kernel=step, axis=None, size=1, band=band), q, k, v)
        for name, g, w in zip(["out", "dq", "dk", "dv"], [got_out, *got_pullback(do)], want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"{type(step).__name__} {name}")


def _sliding_ring(R, q, k, v, segments, window, tile):
    order = np.concatenate([np.asarray(chunk_token_index(rank, R, q.shape[1])) for rank in range(R)])
    mesh = jax.make_mesh((R,), ("ring",), axis_types=(AxisType.Auto,), devices=jax.devices()[:R])
    spec = PartitionSpec(None, "ring")

    def per_device(q, k, v, segments):
        return sliding_ring_attention(q, k, v, segments, kernel=BlockwiseStep(4), axis="ring", size=R,
                                      window=window, tile=tile)

    run = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec))
    laid = lambda x: None if x is None else x[:, order]  # noqa: E731
    out, pullback = jax.vjp(lambda q, k, v: run(q, k, v, laid(segments)), laid(q), laid(k), laid(v))
    restore = np.argsort(order)
    return run, lambda do: [np.asarray(x)[:, restore] for x in (out, *pullback(laid(do)))]


@pytest.mark.parametrize("R, window, tile, packed", [(2, 5, 4, True), (4, 8, 4, False), (4, 3, 8, True),
                                                     (8, 4, 8, False)])
def test_ring_with_a_window_equals_reference_attention(R, window, tile, packed):
    """The halo schedule on rings of 2, 4 and 8 (windows up to half a zigzag
    chunk, tiles of the chunk's halves, packed documents)."""
    B, S, H, K, d = 2, 64, 4, 2, 8
    keys = jax.random.split(jax.random.PRNGKey(R), 4)
    q = jax.random.normal(keys[0], (B, S, H, d))
    k, v = (jax.random.normal(key, (B, S, K, d)) for key in keys[1:3])
    do = jax.random.normal(keys[3], q.shape)
    segments = jnp.asarray(np.cumsum(np.random.default_rng(R).random((B, S)) < 0.1, axis=1), jnp.int32) \
        if packed else None
    out, pullback = jax.vjp(lambda q, k, v: reference_attention(q, k, v, segments, window=window), q, k, v)
    _, got = _sliding_ring(R, q, k, v, segments, window, tile)
    for name, g, w in zip(["out", "dq", "dk", "dv"], got(do), [out, *pullback(do)]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()), err_msg=name)


def _gathered_window(R, q, k, v, segments, window, tile):
    """Windowed attention over keys all-gathered on R devices (the all-gather method's), laid out and restored as
    `_sliding_ring` does."""
    order = np.concatenate([np.asarray(chunk_token_index(rank, R, q.shape[1])) for rank in range(R)])
    mesh = jax.make_mesh((R,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:R])
    spec = PartitionSpec(None, "sp")

    def per_device(q, k, v, segments):
        gather = lambda x: None if x is None else jax.lax.all_gather(x, "sp", axis=1, tiled=True)  # noqa: E731
        return sliding_gathered_attention(q, gather(k), gather(v), segments, gather(segments), kernel=BlockwiseStep(4),
                                          axis="sp", size=R, window=window, tile=tile)

    run = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec))
    laid = lambda x: None if x is None else x[:, order]  # noqa: E731
    out, pullback = jax.vjp(lambda q, k, v: run(q, k, v, laid(segments)), laid(q), laid(k), laid(v))
    restore = np.argsort(order)
    return lambda do: [np.asarray(x)[:, restore] for x in (out, *pullback(laid(do)))]


@pytest.mark.parametrize("R, window, tile, packed", [
    pytest.param(4, 5, 8, True, marks=pytest.mark.slow), (4, 12, 4, False),
    pytest.param(4, 30, 8, True, marks=pytest.mark.slow), pytest.param(2, 64, 8, False, marks=pytest.mark.slow),
    (8, 9, 4, True)])  # CI: across two half chunks, and on 8 ranks with documents
def test_a_window_over_gathered_keys_equals_reference_attention(R, window, tile, packed):
    """The all-gather's windows, a band on every rank's keys at hand: within half a chunk, across two and four
    half chunks, the whole sequence; on 2, 4 and 8 ranks, with packed documents."""
    B, S, H, K, d = 2, 64, 4, 2, 8
    keys = jax.random.split(jax.random.PRNGKey(R + window), 4)
    q = jax.random.normal(keys[0], (B, S, H, d))
    k, v = (jax.random.normal(key, (B, S, K, d)) for key in keys[1:3])
    do = jax.random.normal(keys[3], q.shape)
    segments = jnp.asarray(np.cumsum(np.random.default_rng(R).random((B, S)) < 0.1, axis=1), jnp.int32) \
        if packed else None
    out, pullback = jax.vjp(lambda q, k, v: reference_attention(q, k, v, segments, window=window), q, k, v)
    got = _gathered_window(R, q, k, v, segments, window, tile)
    for name, g, w in zip(["out", "dq", "dk", "dv"], got(do), [out, *pullback(do)]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()), err_msg=name)


@pytest.mark.fast
def test_a_window_over_gathered_keys_visits_only_the_half_chunks_it_reaches():
    """Each half chunk's tiles over its own half and the earlier half chunks within the window's reach (a
    window of w reaches ceil((w - 1) / h) of them), never more than the sequence holds."""
    S, R = 64, 4  # half chunks of 8 tokens
    reached = {w: {back for _, back, _ in gathered_schedule(S // R, w, 8, size=R)} for w in (1, 8, 9, 17, 64)}
    assert reached == {1: {0}, 8: {0, 1}, 9: {0, 1}, 17: {0, 1, 2}, 64: set(range(2 * R))}
    # a window of 9 reaches all of the half chunk before, a window of 8 all but its first key
    assert [call.n for half, back, call in gathered_schedule(S // R, 8, 8, size=R) if back == 1] == [7, 7]
    assert [call.n for half, back, call in gathered_schedule(S // R, 9, 8, size=R) if back == 1] == [8, 8]


def test_the_ring_with_a_window_calls_the_kernel_for_its_chunk_and_two_halos_only():
    """Counted in the compiled program: one collective permute of the keys
    and one of the values per halo in the forward pass, outside any loop (no
    ring of R - 1 steps); and the schedule's calls are the chunk's own tiles
    plus the corners within the window's reach, not the full ring's."""
    R, S, window, tile = 4, 256, 8, 16
    x = jnp.zeros((1, S, 2, 8))
    run, _ = _sliding_ring(R, x, x, x, None, window, tile)
    hlo = run.lower(x, x, x, None).compile().as_text()
    assert hlo.count("collective-permute-start") + hlo.count(" collective-permute(") == 4
    assert "while" not in hlo.split("ENTRY")[1].split("collective-permute")[0]
    calls, halo = schedule(S // R, window, tile, size=R)
    tiles_per_half = S // R // 2 // tile
    own = 2 * (2 * tiles_per_half - 1)  # each tile over itself and the tile before it
    assert halo == S // R // 2 - (window - 1)  # the last w - 1 keys of each neighbour's half
    # a tile over an earlier tile covers only the corner in reach: its first and the earlier tile's last w - 1
    assert all(call.n == window - 1 for call in calls if not call.causal)
    # + the first tile of each half over its halo, and on the last rank (chunks R-1 and R adjacent)
    # B's first tile over A's last
    assert len(calls) == own + 2 + 1 and sum(call.only_last_rank for call in calls) == 1
    full_ring = 2 * tiles_per_half * (2 * tiles_per_half + 1) // 2 + (R - 1) * 2 * tiles_per_half ** 2
    assert len(calls) < full_ring / 3  # 9 against 34


@pytest.mark.fast
def test_layer_types_come_from_the_pattern_when_a_config_names_none():
    model = load_config(None, ["model.preset=gemma3-1b"]).model
    types = family_of(model).layer_types(model)
    assert len(types) == 26 and types.count("full_attention") == 4
    assert [i for i, t in enumerate(types) if t == "full_attention"] == [5, 11, 17, 23]
    runs = family_of(model).layer_runs(model)
    assert runs[:2] == [("sliding_attention", 5), ("full_attention", 1)] and runs[-1] == ("sliding_attention", 2)


@pytest.mark.fast
def test_window_flops_count_what_the_window_computes():
    """Attention FLOPs per token: 12 x H x d x the keys a query sees on
    average, half the sequence for global layers, about w for windowed ones;
    the cuDNN price's visible fraction is the same count."""
    model = load_config(None, ["model.preset=gemma3-12b"]).model
    S, w = 1 << 20, 1024
    global_layers, sliding = 8, 40
    per_key = 12 * model.num_attention_heads * model.dim_per_head
    dense = family_of(model).flops_per_token(model, 0)
    attention = family_of(model).flops_per_token(model, S) - dense
    assert attention == pytest.approx(per_key * (global_layers * S / 2 + sliding * (w - w * (w - 1) / (2 * S))))
    assert mean_visible_keys(4, 2) == pytest.approx((1 + 2 + 2 + 2) / 4)
    assert causal_fraction(4, 2) == pytest.approx(7 / 16) and causal_fraction(4) == pytest.approx(10 / 16)


def test_gemma3_trains_on_ring_x_sp_x_fsdp_equal_to_one_device():
    """The tiny Gemma 3 (16-token windows, a global layer, packed documents)
    on ring 2 x sp 2 x fsdp 2 with UPipe stages and checkpointed layers,
    against one device; windowed and global layers both learn."""
    stack = ["memory.remat=offload_inputs", "attention.heads_per_stage=2", "attention.impl=blockwise"]
    single = _one_device()
    sharded = loss_and_grads(_tiny("mesh.ring=2", "mesh.sp=2", "mesh.fsdp=2", *stack), jax.devices())
    assert_same_result(sharded, single)
    grads = sharded[1]["layers"]
    assert all(np.abs(grads["wq"][i]).max() > 0 for i in range(4))
    assert np.abs(grads["post_attn_norm"]).max() > 0 and np.abs(grads["q_norm"]).max() > 0


def test_gemma3_trains_on_allgather_sp_x_fsdp_equal_to_one_device():
    """All-gather context parallelism on sp 4 x fsdp 2: the 16-token windows reach past half of a device's
    chunk (8 tokens), so they run as a band on the gathered keys; windowed and global layers both learn."""
    sharded = loss_and_grads(_tiny("attention.sp_method=allgather", "mesh.sp=4", "mesh.fsdp=2"), jax.devices())
    assert_same_result(sharded, _one_device())
    assert all(np.abs(sharded[1]["layers"]["wq"][i]).max() > 0 for i in range(4))


@pytest.mark.parametrize("mesh", [["mesh.sp=8"], pytest.param(["mesh.ring=2", "mesh.fsdp=4"], marks=pytest.mark.slow)],
                         ids=["sp8", "ring2-fsdp4"])  # CI runs the ring inside ring x sp x fsdp above
def test_gemma3_on_sp_or_ring_alone_equals_one_device(mesh):
    assert_same_result(loss_and_grads(_tiny(*mesh), jax.devices()), _one_device())


@functools.cache
def _one_device():
    """The reference the layouts are compared with, computed once per test process."""
    return loss_and_grads(_tiny(), jax.devices()[:1])


@pytest.mark.fast
@pytest.mark.parametrize("overrides, message", [
    (["mesh.ring=4"], "model.sliding_window (16) is longer than the 8 tokens of each zigzag chunk"),
    (["memory.remat=save_inputs", "memory.layers_per_checkpoint=2"],
     "must divide each run of layers of one type, or their period where their types repeat (2, 1, 1 layers"),
])
def test_window_config_mistakes_are_one_line(overrides, message):
    with pytest.raises(JlongError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _tiny(*overrides)


@pytest.mark.fast
def test_a_llama_with_a_window_or_layer_types_is_refused():
    with pytest.raises(JlongError, match="model.sliding_window is not part of"):
        small_config("model.sliding_window=16")
    with pytest.raises(JlongError, match="model.layer_types is not part of model.family=llama"):
        small_config("model.layer_types=[full_attention,full_attention]")


def test_transformers4_config_form_and_refusals(tmp_path):
    """rope_theta / rope_scaling / rope_local_base_freq at the top level and
    the pattern in place of layer_types, as transformers 4 wrote Gemma 3
    configs; soft-capping is refused in one line."""
    hf_model = small_hf_model("gemma3", num_hidden_layers=4, layer_types=None, sliding_window_pattern=2)
    hf_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["full_attention"]["rope_theta"], rope_scaling={"type": "linear", "factor": 2.0},
                  rope_local_base_freq=rope["sliding_attention"]["rope_theta"], sliding_window_pattern=2)
    del config["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = jlong.from_hf(tmp_path)
    assert family_of(model.config).layer_types(model.config) == ("sliding_attention", "full_attention") * 2
    tokens = np.random.default_rng(1).integers(0, 96, (2, 70))
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), hf_logits(hf_model, tokens), atol=1e-4)
    config["final_logit_softcapping"] = 30.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(JlongError, match="final_logit_softcapping=30.0 is not supported"):
        jlong.from_hf(tmp_path)


def test_the_text_model_of_an_image_text_checkpoint_matches_transformers(tmp_path, capfd):
    """A Gemma3ForConditionalGeneration checkpoint: jlong reads its text_config
    and language-model tensors, says in one line that the vision tower is
    left out, and gives the model's text-only logits."""
    import torch
    import transformers

    from hf_models import GEMMA3

    text = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, rms_norm_eps=1e-6, **GEMMA3)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=95, boi_token_index=93, eoi_token_index=94)
    torch.manual_seed(0)
    hf_model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    hf_model.save_pretrained(tmp_path)
    capfd.readouterr()
    model = jlong.from_hf(tmp_path)
    notes = [line for line in capfd.readouterr().err.splitlines() if line.startswith("jlong:")]
    assert len(notes) == 1 and "image-text checkpoint" in notes[0] and "vision tower is left out" in notes[0]
    assert model.config.family == "gemma3_text"
    tokens = np.random.default_rng(1).integers(0, 90, (2, 70))
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), hf_logits(hf_model, tokens), atol=1e-4)


@pytest.mark.fast
def test_the_planner_groups_layers_by_two_only_where_every_loop_body_allows():
    """`jlong maxlen`'s most frugal settings keep one input per two layers
    where k is free and divides every loop's body: Gemma-3-12B's layers repeat
    with a period of 6 (one loop over the periods), Llama's 32 layers are one
    run; Gemma 3 with a layer count that breaks the period keeps runs of 5
    and 1, which cannot be grouped so."""
    from helpers import REPO

    from jlong.planner.memory_choice import frugal

    assert frugal(load_config(REPO / "configs" / "gemma3-12b-1m.yaml")).memory.layers_per_checkpoint == 2
    broken = load_config(REPO / "configs" / "gemma3-12b-1m.yaml", ["model.num_hidden_layers=46"])
    assert frugal(broken).memory.layers_per_checkpoint == 1
    assert frugal(load_config(REPO / "configs" / "llama3-8b-5m.yaml")).memory.layers_per_checkpoint == 2
