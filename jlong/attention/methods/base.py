"""What a sequence-parallel method is: the way attention runs over a
sequence sharded across devices, behind one interface.

A method says what it asks of a run's config (its rules, what the sequence
length must be a multiple of, how many heads a stage takes by default),
how the batch is laid out along the sequence for it, and runs attention
(`SequenceParallelMethod.attention`): x [B, S, D] in, the attention's
output projection summed over the head stages out, added into x or alone.

The stages share one loop (`sum_over_head_stages`): each stage is
rematerialised keeping only the attention output and its log-sum-exp, so
nothing O(heads) but those outputs lives between the forward and the
backward pass.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax

from jlong.attention import kernels
from jlong.attention.kernels import check_impl
from jlong.attention.ring import ATTENTION_LSE, ATTENTION_OUT
from jlong.errors import JlongError
from jlong.ops import head_stages
from jlong.ops.zigzag import SequenceLayout

if TYPE_CHECKING:
    from jlong.config import Config

# Between forward and backward each stage keeps only the attention's output
# and log-sum-exp (named by `jlong.attention.ring`, whatever the kernel);
# q, k, v and the exchanges are recomputed.
KEEP_ATTENTION_OUTPUT = jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT, ATTENTION_LSE)


@dataclasses.dataclass(frozen=True)
class SequenceParallelMethod:
    name: str  # attention.sp_method
    # Whether it runs layers with sliding windows (the kernel carries the window: `AttentionKernel.window`).
    sliding_windows: bool = True
    # Whether it runs attention sinks (`QKVProjection.sinks`: the `attn_sinks` logits on every path). False
    # unless a method says so: one that ignored `projection.sinks` would return attention without them.
    sinks: bool = False

    def default_heads_per_stage(self, config: Config) -> int:
        raise NotImplementedError

    def heads_per_stage(self, config: Config) -> int:
        """U: attention.heads_per_stage, its default when unset, every head for "all"."""
        u = config.attention.heads_per_stage
        if u == "auto":
            raise JlongError("attention.heads_per_stage=auto is chosen by the planner before a program is built: "
                             "resolve the config with jlong.planner.memory_choice.choose first")
        if u is None:
            return self.default_heads_per_stage(config)
        return config.model.num_attention_heads if u == "all" else u

    def granule(self, config: Config) -> tuple[int, str]:
        """What seq_len must be a multiple of on this mesh, and why (for the error)."""
        raise NotImplementedError

    def check_kernel(self, config: Config) -> None:
        """Raises a one-line `JlongError` for an attention.impl that is no kernel the method can run."""
        check_impl(config.attention.impl)

    def check_sinks(self, impl: str) -> None:
        """Raises a one-line `JlongError` when this method, or the kernel that
        attention.impl `impl` names, cannot run attention sinks."""
        if not self.sinks:
            raise JlongError(f"attention.sp_method={self.name} does not run attention sinks, which this model has: "
                             "use attention.sp_method=ulysses")
        kernels.check_sinks(impl)

    def check(self, config: Config) -> None:
        """Raises a one-line `JlongError` for a config this method cannot run:
        here, a length that is not a multiple of the granule, or a zigzag
        chunk that the blockwise kernel's blocks do not divide."""
        check_seq_len(config, *self.granule(config))
        if (ranks := self.layout(config).ranks) > 1:
            chunk, block = config.train.seq_len // (2 * ranks), config.attention.block_size
            if chunk % min(block, chunk):
                raise JlongError(f"attention.block_size ({block}) must divide the {chunk} tokens of each zigzag "
                                 f"chunk (train.seq_len / (2 x {ranks}) with attention.sp_method={self.name})")

    def check_stage_size(self, config: Config, step: int, requirement: str) -> None:
        """U must be a multiple of `step` that divides the heads (`requirement` says so for the error)."""
        if config.attention.heads_per_stage == "auto":  # the planner chooses among the stage sizes that work
            return
        H, U = config.model.num_attention_heads, self.heads_per_stage(config)
        if U % step or H % U:
            workable = [u for u in range(step, H + 1, step) if H % u == 0]
            raise JlongError(f"attention.heads_per_stage ({U}) must {requirement}; values that work: "
                             f"{', '.join(map(str, workable))} (or all)")

    def stage_step(self, config: Config) -> int:
        """What every U of this method is a multiple of."""
        raise NotImplementedError

    def stage_sizes(self, config: Config) -> list[int]:
        """Every workable U, largest first: the multiples of `stage_step` that divide the heads."""
        H, step = config.model.num_attention_heads, self.stage_step(config)
        return [u for u in range(H, step - 1, -1) if u % step == 0 and H % u == 0]

    def layout(self, config: Config) -> SequenceLayout:
        """How the batch is laid out along the sequence for this method."""
        raise NotImplementedError

    def shortest_window(self, config: Config) -> int:
        """The fewest tokens one kernel call attends over (the kernel's choice
        depends on it): the sequence, or in a zigzag layout half a chunk
        (`jlong.attention.ring`)."""
        ranks = self.layout(config).ranks
        return config.train.seq_len if ranks == 1 else config.train.seq_len // (2 * ranks)

    def latent_exchange(self, config: Config) -> tuple[str, int] | None:
        """(what moves keys and values between devices, how many heads' keys and values a device receives
        per move) where a projection's latent could move instead (`jlong.attention.latent`); None where
        this method on this mesh moves none."""
        return None

    def check_linear_attention(self, config: Config, layer) -> None:
        """Raises a one-line `JlongError` when this method cannot run the
        model's linear-attention layers (`layer`: a `GatedDeltaNet`) on the mesh."""
        raise JlongError(f"attention.sp_method={self.name} does not run linear-attention (Gated DeltaNet) layers, "
                         f"which model.family={config.model.family} has: use attention.sp_method=ulysses")

    def linear_attention(self, params, x_BSD, segment_ids_BS, *, layer, shards, tile=0, stages=1,
                         keep_state=False):
        """x + the linear-attention layer `layer` (a `GatedDeltaNet`) of x [B, S, D];
        its per-token output projection `tile` tokens at a time on each device (0:
        all), its heads in up to `stages` stages (`GatedDeltaNet.head_plan`). With
        `keep_state`, (that, what decoding on from the sequence's end needs)."""
        raise JlongError(f"attention.sp_method={self.name} does not run linear-attention (Gated DeltaNet) layers")

    def attention(self, params, x_BSD, positions_BS, segment_ids_BS, *, projection, heads, kernel, shards,
                  unroll_stages=False, add_to_input=True):
        """x + attention of x [B, S, D] (its projection normalises x first; the
        output projection included), or the attention alone without
        `add_to_input`. `heads` is (H, K, U); `shards` the mesh as the model
        sees it; positions default to the tokens' indices in the sequence."""
        raise NotImplementedError


def check_seq_len(config: Config, granule: int, what: str) -> None:
    seq_len = config.train.seq_len
    if seq_len % granule:
        lower = seq_len // granule * granule
        raise JlongError(f"train.seq_len ({seq_len}) must be a multiple of {what}; "
                         f"nearest valid: {lower or granule} or {lower + granule}")


def sum_over_head_stages(stage_output, x_BsD, num_stages: int, *, unroll: bool, add_to_input: bool):
    """`jlong.ops.head_stages.sum_over_head_stages` keeping each stage's attention output and log-sum-exp."""
    return head_stages.sum_over_head_stages(stage_output, x_BsD, num_stages, policy=KEEP_ATTENTION_OUTPUT,
                                            unroll=unroll, add_to_input=add_to_input)
