"""A Hugging Face checkpoint loads straight into its planned shardings: no
array passes whole through one device, and the host holds little beyond the
shards themselves."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import leaf_at

import jlong
from jlong.config import ModelConfig, load_config
from jlong.model.transformer import Transformer
from jlong.parallel.placement import make_mesh
from jlong.program.train_program import TrainProgram

# float32 weights of about 190 MiB: big enough that the host's peak during
# the load is measured against the checkpoint, not against Python's noise.
MODEL = ModelConfig(
    vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    model = Transformer(MODEL, rngs=nnx.Rngs(3))
    jlong.to_hf(model, path)
    return path


def fsdp8(path):
    return load_config(None, [f"model.hf_path={path}", "mesh.fsdp=8", "train.batch_size=8", "train.seq_len=64"])


def test_every_array_arrives_in_its_planned_sharding(checkpoint):
    config = fsdp8(checkpoint)
    program = TrainProgram(config, make_mesh(config.mesh))
    params = program.load_hf_params(str(checkpoint))
    unsharded = nnx.to_pure_dict(nnx.state(jlong.from_hf(checkpoint)))
    planned = jax.tree_util.tree_leaves_with_path(program.param_shardings)
    assert len(planned) == len(jax.tree.leaves(params)) == 3 + 9  # embed, final norm, lm_head; 9 layer stacks
    for path, sharding in planned:
        array = leaf_at(params, path)
        assert array.sharding == sharding, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(array), np.asarray(leaf_at(unsharded, path)))
    # Every dimension here is a multiple of 8, so FSDP splits every array over all eight devices.
    assert all(len(s.device_set) == 8 and not s.is_fully_replicated for _, s in planned)


PEAK_PROBE = textwrap.dedent("""
    import json, sys
    import jax
    from jlong.config import load_config
    from jlong.parallel.placement import make_mesh
    from jlong.program.train_program import TrainProgram

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    path = sys.argv[1]
    config = load_config(None, [f"model.hf_path={path}", "mesh.fsdp=8", "train.batch_size=8", "train.seq_len=64"])
    program = TrainProgram(config, make_mesh(config.mesh))
    before = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:  # restart the peak (VmHWM) from here
        f.write("5")
    params = jax.block_until_ready(program.load_hf_params(path))
    print(json.dumps({"before": before, "peak": status("VmHWM:")}))
""")


def test_peak_host_memory_stays_under_one_and_a_half_checkpoints(checkpoint):
    checkpoint_bytes = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", PEAK_PROBE, str(checkpoint)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    memory = json.loads(result.stdout.strip().splitlines()[-1])
    grown = memory["peak"] - memory["before"]
    # On CPU the eight devices' shards are themselves host memory: one checkpoint's worth.
    assert checkpoint_bytes <= grown < 1.5 * checkpoint_bytes, (grown, checkpoint_bytes)
