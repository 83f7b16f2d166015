"""A model family defined outside jlong, as a researcher would add one: a
Llama whose attention and MLP outputs are normalised before the residual
add (the "sandwich" norms of Gemma 2/3 and OLMo 2), registered by name."""

import functools

from jlong.families import ParamSpec, Role, blocks, register
from jlong.families.llama import LlamaFamily
from jlong.ops.layers import rms_norm, swiglu
from jlong.ops.shards import HIDDEN
from jlong.ops.tiling import per_sequence_tile


class PostNormLlama(LlamaFamily):
    def layer_params(self, model):
        D = model.hidden_size
        return {
            **super().layer_params(model),
            "post_attn_norm": ParamSpec((D,), ("embed",), Role.NORM),
            "post_mlp_norm": ParamSpec((D,), ("embed",), Role.NORM),
        }

    def block(self, p, x_BSD, positions_BS, segment_ids_BS, model, options):
        constrain, eps = options.shards.constrain, model.rms_norm_eps
        # The norm is not linear: it applies to the sum over all UPipe stages,
        # so the stages add into a buffer of their own, not into x.
        a_BSD = blocks.attention(p, x_BSD, positions_BS, segment_ids_BS, model, options, add_to_input=False)
        x_BSD = constrain(x_BSD + rms_norm(a_BSD, p["post_attn_norm"], eps), HIDDEN)
        names = (*blocks.SWIGLU_PARAMS, "post_mlp_norm")
        mlp = functools.partial(_post_normed_mlp, eps=eps)
        x_BSD = per_sequence_tile(mlp, {n: p[n] for n in names}, x_BSD, shards=options.shards, tile=options.mlp_tile)
        return constrain(x_BSD, HIDDEN)


def _post_normed_mlp(p, x_BSD, *, eps):
    h_BSD = swiglu(rms_norm(x_BSD, p["mlp_norm"], eps), p["w_gate"], p["w_up"], p["w_down"])
    return x_BSD + rms_norm(h_BSD, p["post_mlp_norm"], eps)


POST_NORM_LLAMA = register(PostNormLlama("test_postnorm_llama", "PostNormLlamaForCausalLM"))
