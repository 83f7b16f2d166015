"""The sampler: prompts in, completions out, on a training program's mesh
with the weights it is handed.

A batch of prompts is right-aligned into one padded length P
(`prompt_layout`), prefilled by the training forward (`prefill`), and then
decoded one token per sequence at a time (`decode`) in a jitted loop of a
few steps per call, with every cache donated and updated in place. The
N samples of a prompt share its prefill and its prompt cache. Each step
draws the next token (`sampling`), writes the new keys and values into
their slots (split over the sequence's devices as the prompt's are) and
the linear-attention layers' states, and stops a sequence at a stop id or
at `max_new_tokens`.

Programs are compiled once per shape: P is the batch's longest prompt
rounded up to a power of two of the sequence granule (so few lengths
compile), the decode cache holds `max_new_tokens` slots rounded up to the
sequence's shards.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jlong.attention.methods import method_of
from jlong.errors import JlongError
from jlong.families import family_of
from jlong.generation.decode import PROMPT_KV, PROMPT_POSITIONS, WINDOW_KV, WINDOW_POSITIONS, DecodeLayers
from jlong.generation.prefill import PrefillLayers, last_hidden, window_slot_positions
from jlong.generation.prompt_layout import PromptBatch
from jlong.generation.sampling import SamplingSettings, next_tokens, row_keys
from jlong.linear_attention.gated_deltanet import LINEAR_ATTENTION
from jlong.attention.methods.ulysses import KEPT_STATE
from jlong.model.loss import output_logits
from jlong.model.transformer import ForwardOptions
from jlong.lora.nf4 import is_quantized
from jlong.parallel.placement import MeshShards, compute_sharding, replicated

STEPS_PER_CALL = 8  # decode steps per program call: the host sees progress (and stops) between calls
ROWS = ("batch",)


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sample of one prompt."""

    prompt_index: int
    sample: int
    prompt_tokens: int
    ids: list[int]
    logprobs: list[float]  # of each id, under logits / temperature (greedy: the raw logits)
    finish_reason: str  # "stop" (a stop id, included in ids) or "length"


@dataclasses.dataclass(frozen=True)
class Request:
    """How to complete a list of prompts."""

    max_new_tokens: int
    settings: SamplingSettings = SamplingSettings()
    num_samples: int = 1
    seed: int = 0
    stop_ids: tuple[int, ...] = ()


WHOLE_WEIGHTS_SHARE = 0.35  # decoding holds the weights whole on each device when they take at most this share


class Sampler:
    """Generates with a `TrainProgram`'s model, mesh and parameter layout; `generate` takes the parameters
    (as the program holds them between steps).

    Decoding reads every weight once per token. Where the weights in the compute dtype fit whole on a device
    (`whole_weights`; by default when they take at most `WHOLE_WEIGHTS_SHARE` of its memory, always on the CPU),
    each `generate` call gathers them once from their FSDP shards and decodes with that copy; otherwise each
    decode step gathers every layer's, as the training step does."""

    def __init__(self, program, whole_weights: bool | None = None):
        self.program, self.config, self.mesh = program, program.config, program.mesh
        config = self.config
        self.layout = method_of(config).layout(config)
        self.family = family_of(config.model)
        self.rows_multiple = config.mesh.data * config.mesh.fsdp  # prompts per batch split over data x fsdp
        self.decode_options = dataclasses.replace(
            program.options, shards=MeshShards(self.mesh, whole=("seq",)), remat="none", remat_segments=(),
            layers_per_checkpoint=1, mlp_tile=0, loss_tile=0)
        self._prefill: dict[int, Callable] = {}
        self.whole_weights = _whole_weights_fit(program) if whole_weights is None else whole_weights
        # (parameters, state, steps, samples per prompt) -> the state `steps` tokens on, updated in place
        self.decode = jax.jit(self._decode_steps, static_argnums=(2, 3), donate_argnums=(1,))
        self.gather_weights = jax.jit(self._compute_copy, out_shardings=replicated(self.mesh))

    # -- lengths

    def padded_length(self, longest_prompt: int, max_new_tokens: int) -> int:
        """P for a batch whose longest prompt has `longest_prompt` tokens: a power of two of the sequence
        granule, or the granule's multiple just above the prompt where that would pass train.seq_len."""
        seq_len, granule = self.config.train.seq_len, self.config.sequence_granule
        if longest_prompt + max_new_tokens > seq_len:
            raise JlongError(f"a prompt of {longest_prompt:,} tokens and {max_new_tokens:,} new ones pass "
                             f"train.seq_len ({seq_len:,}), the length the config plans for: raise train.seq_len, "
                             "or ask for fewer new tokens")
        blocks = -(-longest_prompt // granule)
        bucket = granule << max(0, blocks - 1).bit_length()
        return bucket if bucket + max_new_tokens <= max(seq_len, granule) else blocks * granule

    def new_slots(self, max_new_tokens: int) -> int:
        """Cache slots for the decoded tokens: whole decode calls, split evenly over the sequence's devices."""
        multiple = math.lcm(STEPS_PER_CALL, self.config.mesh.sequence_shards)
        return -(-max_new_tokens // multiple) * multiple

    # -- generating

    def generate(self, params, prompts: Sequence[Sequence[int]], request: Request, *, batch_size: int | None = None,
                 prompt_indices: Sequence[int] | None = None,
                 on_batch: Callable[[list[Completion]], None] | None = None,
                 on_tokens: Callable[[int], None] | None = None) -> list[Completion]:
        """Every prompt's `request.num_samples` completions, in prompt order then sample order, `batch_size`
        prompts at a time (default train.batch_size); `prompt_indices` key each prompt's draws (default:
        its index in `prompts`), so a prompt's samples do not depend on its batch. `on_batch` hears each
        batch's completions as they are done, `on_tokens` of every new token count."""
        indices = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
        size = batch_size or self.config.train.batch_size
        size = -(-size // self.rows_multiple) * self.rows_multiple
        done = []
        for first in range(0, len(prompts), size):
            batch = self._batch(params, [list(p) for p in prompts[first:first + size]], indices[first:first + size],
                                request, size, on_tokens)
            done += batch
            if on_batch:
                on_batch(batch)
        return done

    def _batch(self, params, prompts, indices, request: Request, size: int, on_tokens) -> list[Completion]:
        count, N = len(prompts), request.num_samples
        filler = size - count  # whole batches: one-token prompts whose rows start done
        prompts = prompts + [[0]] * filler
        P = self.padded_length(max(len(p) for p in prompts), request.max_new_tokens)
        batch = PromptBatch.of(prompts, P)
        caches, logits = self.prefill_program(P)(params, self._placed(batch.arrays()))
        state = self._start(batch, caches, logits, request, indices + [0] * filler, active=count)
        weights = self.decode_weights(params)
        steps, told = 0, 0
        while steps < request.max_new_tokens:
            state = self.decode(weights, state, STEPS_PER_CALL, N)
            steps += STEPS_PER_CALL
            done = np.asarray(jax.device_get(state["done"]))
            if on_tokens:
                made = int(np.asarray(jax.device_get(state["made"])).sum())
                on_tokens(made - told)
                told = made
            if done.all():
                break
        tokens, logprobs, made = (np.asarray(jax.device_get(state[k])) for k in ("tokens", "logprobs", "made"))
        stops = set(request.stop_ids)
        completions = []
        for row in range(count * N):
            b, n = divmod(row, N)
            ids = tokens[row, : made[row]].tolist()
            reason = "stop" if ids and ids[-1] in stops else "length"
            completions.append(Completion(indices[b], n, len(prompts[b]), ids, logprobs[row, : made[row]].tolist(),
                                          reason))
        return completions

    def _placed(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        sharding = compute_sharding(self.mesh, ("batch", "seq"))
        return {key: jax.device_put(self.layout.lay_out(value), sharding) for key, value in arrays.items()
                if key != "slot_positions"}

    # -- the prefill

    def prefill_program(self, P: int):
        """The jitted prefill of batches of padded length P: (parameters, the batch's arrays in the model's
        layout) -> (each layer type's caches, each prompt's next-token logits [B, V])."""
        if P not in self._prefill:
            # The run's settings at the prefill's length (its kernel choice reads the length); not a run config
            # of its own, so not checked as one.
            at_length = self.config.model_copy(update={"train": self.config.train.model_copy(update={"seq_len": P})})
            options = ForwardOptions.for_training(at_length, MeshShards(self.mesh), self.mesh.devices.flat[0].platform)
            options = dataclasses.replace(options, remat="none", remat_segments=(), layers_per_checkpoint=1)
            self._prefill[P] = jax.jit(functools.partial(self._prefill_step, options=options, padded_length=P),
                                       in_shardings=(self.program.rest_shardings, None))
        return self._prefill[P]

    def _model(self, params):
        program = self.program
        return program.bind(program.optimizer.compute_params(params, program.param_shardings))

    def decode_weights(self, params):
        """What the decode program takes: the weights as held, or with `whole_weights` their compute-dtype
        copy whole on every device."""
        return self.gather_weights(params) if self.whole_weights else params

    def _compute_copy(self, params):
        """The weights in the compute dtype (a 4-bit base as it is: dequantized layer by layer in the forward)."""
        dtype = jnp.dtype(self.config.train.compute_dtype)
        params = self.program.optimizer.compute_params(params, self.program.param_shardings)
        return jax.tree.map(lambda w: w if is_quantized(w) or not jnp.issubdtype(w.dtype, jnp.floating)
                            else w.astype(dtype), params, is_leaf=is_quantized)

    def _prefill_step(self, params, batch, *, options, padded_length):
        """(each layer type's cache entries stacked over its layers, the next token's logits [B, V])."""
        model = self._model(params)
        layers = PrefillLayers(batch["slots"], padded_length)
        hidden, _, written = model.run_layers(batch["tokens"], batch["segment_ids"], batch["positions"],
                                              options=options, layer_io=layers)
        last = last_hidden(hidden, batch["slots"], padded_length, options.shards)
        return written, output_logits(last[:, None], model.output_weights(last.dtype))[:, 0]

    # -- the decode state

    def _start(self, batch: PromptBatch, caches: dict, logits, request: Request, indices: list[int], active: int):
        """The decode loop's state after the prefill, placed on the mesh."""
        rows = self.host_rows(batch, request, indices, active)
        shardings = self.state_shardings(jax.eval_shape(self.initial_state, caches, logits, rows))
        return jax.jit(self.initial_state, out_shardings=shardings, donate_argnums=(0,))(caches, logits, rows)

    def host_rows(self, batch: PromptBatch, request: Request, indices: list[int], active: int) -> dict:
        """What the decode state takes from the host: per row (prompt x sample) its key, position and whether it
        is a filler, the request's settings, and the slot positions of the prompt cache."""
        N, B = request.num_samples, len(indices)
        R, M = B * N, self.new_slots(request.max_new_tokens)
        rows = lambda x: np.repeat(x, N, axis=0)  # noqa: E731  [B, ...] -> [R, ...], sample-minor
        slot_positions = batch.slot_positions()
        return {
            "keys": row_keys(request.seed, rows(np.asarray(indices)), np.tile(np.arange(N), B)),
            "position": rows(batch.lengths),
            "done": rows(np.arange(B) >= active),
            "max_new": np.int32(request.max_new_tokens),
            "padded_length": np.int32(batch.padded_length),
            "stop_ids": np.asarray(request.stop_ids or (-1,), np.int32),
            "settings": request.settings.as_arrays(),
            "new_positions": np.full((R, M), -1, np.int32),
            "prompt_positions": self.layout.lay_out(slot_positions),
            "window_positions": {window: rows(window_slot_positions(slot_positions, window))
                                 for window in sorted(self.family.windows(self.config.model))},
        }

    def initial_state(self, caches: dict, logits, rows: dict) -> dict:
        """The decode loop's state after the prefill: the caches (the prompt's, and empty slots for the new
        tokens; per-sample copies where the samples' paths part), each row's next logits, key and position."""
        R, M = rows["new_positions"].shape
        N = R // logits.shape[0]
        state = {
            "logits": jnp.repeat(logits, N, axis=0),
            "made": jnp.zeros(R, jnp.int32),
            "step": jnp.int32(0),
            "tokens": jnp.zeros((R, M), jnp.int32),
            "logprobs": jnp.zeros((R, M), jnp.float32),
            "caches": {},
            "positions": {"new": rows["new_positions"]},
            **{key: rows[key] for key in ("keys", "position", "done", "max_new", "padded_length", "stop_ids",
                                          "settings")},
        }
        for kind, written in caches.items():
            if kind == LINEAR_ATTENTION:  # [layers, stages, B, ...] -> per sample
                state["caches"].update({f"{kind}/{name}": jnp.repeat(a, N, axis=2) for name, a in written.items()})
            elif window := self.family.attention_window(self.config.model, kind):
                state["caches"].update({f"{kind}/{name}": jnp.repeat(a, N, axis=1) for name, a in written.items()})
                state["positions"][f"window{window}"] = rows["window_positions"][window]
            else:
                L, _, _, K, d = written["k"].shape
                state["caches"].update({f"{kind}/{name}": written[name] for name in ("k", "v")})
                state["caches"].update({f"{kind}/new_{name}": jnp.zeros((L, R, M, K, d), written[name].dtype)
                                        for name in ("k", "v")})
                state["positions"]["prompt"] = rows["prompt_positions"]
        return state

    def state_shardings(self, state: dict):
        """Where each entry of a decode state lives: caches split as the sequence is (a window's and a linear
        layer's as the prefill left them), rows over data x fsdp, settings whole."""
        mesh = self.mesh

        def of(axes):
            return compute_sharding(mesh, axes)

        def cache(name: str):
            kind = name.split("/")[0]
            if kind == LINEAR_ATTENTION:
                return of(("layers", *KEPT_STATE))
            return of(("layers", *(WINDOW_KV if self.family.attention_window(self.config.model, kind) else PROMPT_KV)))

        shardings = jax.tree.map(lambda _: replicated(mesh), state)
        for key in ("logits", "keys", "position", "done", "made", "tokens", "logprobs"):
            shardings[key] = of(ROWS)
        shardings["caches"] = {name: cache(name) for name in state["caches"]}
        shardings["positions"] = {name: of(PROMPT_POSITIONS if name in ("prompt", "new") else WINDOW_POSITIONS)
                                  for name in state["positions"]}
        return shardings

    # -- decoding

    def _decode_steps(self, params, state, steps: int, samples: int):
        """`steps` decode steps of rows of `samples` per prompt: each draws the next token of every row from
        its logits, records it, and runs it through the model for the logits of the one after. `params` are
        `decode_weights`'."""
        model = self.program.bind(params) if self.whole_weights else self._model(params)
        options, shards = self.decode_options, self.decode_options.shards
        weights = model.output_weights(jnp.dtype(options.compute_dtype))

        def one_step(_, state):
            step, done = state["step"], state["done"]
            token, logprob = next_tokens(state["logits"], state["keys"], step, state["settings"])
            recording = ~done
            state = {**state,
                     "tokens": _put_column(state["tokens"], jnp.where(recording, token, 0), step),
                     "logprobs": _put_column(state["logprobs"], jnp.where(recording, logprob, 0.0), step),
                     "made": state["made"] + recording,
                     "done": done | jnp.isin(token, state["stop_ids"]) | (step + 1 >= state["max_new"])}
            layers = DecodeLayers(
                {name: (name.split("/")[0], a) for name, a in state["caches"].items()}, samples,
                prompt_positions=state["positions"].get("prompt"), new_positions=state["positions"]["new"],
                window_positions={int(name.removeprefix("window")): a for name, a in state["positions"].items()
                                  if name.startswith("window")})
            position = state["position"]
            hidden, _, written = model.run_layers(token[:, None], None, position[:, None], options=options,
                                                  layer_io=layers)
            logits = output_logits(hidden, weights)[:, 0]
            caches, positions = dict(state["caches"]), dict(state["positions"])
            for kind, entries in written.items():
                if kind == LINEAR_ATTENTION:
                    caches.update({f"{kind}/{name}": a for name, a in entries.items()})
                elif window := self.family.attention_window(self.config.model, kind):
                    slot = (state["padded_length"] + step) % window
                    for name in ("k", "v"):
                        caches[f"{kind}/{name}"] = jax.lax.dynamic_update_slice_in_dim(
                            caches[f"{kind}/{name}"], entries[name].astype(caches[f"{kind}/{name}"].dtype), slot,
                            axis=2)
                    positions[f"window{window}"] = _put_column(positions[f"window{window}"], position, slot)
                else:
                    for name in ("k", "v"):
                        caches[f"{kind}/new_{name}"] = _write_slot(caches[f"{kind}/new_{name}"], entries[name],
                                                                   step, shards)
            positions["new"] = _write_position(positions["new"], position, step, shards)
            return {**state, "caches": caches, "positions": positions, "logits": logits, "position": position + 1,
                    "step": step + 1}

        return jax.lax.fori_loop(0, steps, one_step, state)


def _whole_weights_fit(program) -> bool:
    """Whether the compute-dtype weights take at most WHOLE_WEIGHTS_SHARE of a device's memory (a CPU: yes)."""
    device = program.mesh.devices.flat[0]
    limit = (device.memory_stats() or {}).get("bytes_limit") if device.platform == "gpu" else None
    if not limit:
        return device.platform != "gpu"
    itemsize = jnp.dtype(program.config.train.compute_dtype).itemsize
    whole = sum(math.prod(s.shape) * itemsize for s in jax.tree.leaves(program.abstract_params))
    return whole <= WHOLE_WEIGHTS_SHARE * limit


def _put_column(x_RM, value_R, column):
    return jax.lax.dynamic_update_slice_in_dim(x_RM, value_R[:, None].astype(x_RM.dtype), column, axis=1)


def _sequence_index(shards):
    """This device's index among the sequence's devices (ring-major, as the cache's slots are split)."""
    ring, sp = shards.axis("ring"), shards.axis("sp")
    index = jax.lax.axis_index(ring) * shards.size("sp") if ring else 0
    return index + (jax.lax.axis_index(sp) if sp else 0)


def _owned_update(x, value, slot, axis: int, shards):
    """x with `value` (one slot wide along `axis`) at global slot `slot`, on the device that holds that slot."""
    size = x.shape[axis]
    local = slot - _sequence_index(shards) * size
    at = jnp.clip(local, 0, size - 1)
    old = jax.lax.dynamic_slice_in_dim(x, at, 1, axis=axis)
    owned = (local >= 0) & (local < size)
    return jax.lax.dynamic_update_slice_in_dim(x, jnp.where(owned, value.astype(x.dtype), old), at, axis=axis)


def _write_slot(cache_LRMKd, value_LR1Kd, slot, shards):
    """The decoded tokens' keys or values with this step's in slot `slot`."""
    run = shards.map(functools.partial(_owned_update, axis=2, shards=shards),
                     (("layers", *PROMPT_KV), ("layers", "batch", "seq", "kv_heads", "head_dim"), ()),
                     ("layers", *PROMPT_KV))
    return run(cache_LRMKd, value_LR1Kd, slot)


def _write_position(positions_RM, position_R, slot, shards):
    run = shards.map(lambda x, v, s: _owned_update(x, v[:, None], s, 1, shards),
                     (PROMPT_POSITIONS, ROWS, ()), PROMPT_POSITIONS)
    return run(positions_RM, position_R, slot)
