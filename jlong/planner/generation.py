"""`jlong plan --generate`: what generating with a config needs and costs,
read from the sampler's compiled programs (`jlong.generation.sampler`) for
the configured mesh on a `PlanTarget`, nothing allocated.

Two programs are compiled with abstract inputs: the prefill of a batch of
prompts (the training forward, keeping each layer's cache) and one decode
call (`STEPS_PER_CALL` tokens per sequence). Memory is per device: the
parameters, the caches after the prefill (the prompt's keys and values split
as the sequence is, the slots for the new tokens, sliding windows' buffers,
Gated DeltaNet states), and each program's peak (its arguments and
temporaries). On GPU targets the step-cost model (`jlong.planner.step_cost`)
prices each program: the prefill's time, and a decode step's (one token for
every sequence), estimates both; beside it the floor no decode step beats,
every weight and cache byte a device holds read once from HBM. Where the
weights in the compute dtype fit whole on a device (`Sampler`'s rule), the
decode program takes that copy, gathered once per rollout, and holds it
beside the weights' own shards; otherwise a decode step gathers each
layer's from its FSDP shards, as training does. The longest
prompt that fits is found from two plans (device bytes are close to linear
in the prompt's length) and checked by a third.
"""

from __future__ import annotations

import dataclasses

import math

import jax
import jax.numpy as jnp
import numpy as np

from jlong.config import Config, with_values
from jlong.errors import JlongError
from jlong.generation.prompt_layout import PromptBatch
from jlong.generation.sampler import STEPS_PER_CALL, WHOLE_WEIGHTS_SHARE, Request, Sampler
from jlong.jax_private import private
from jlong.parallel.placement import compute_sharding, make_mesh
from jlong.planner.flops import model_flops_per_token
from jlong.planner.hlo import parse_module
from jlong.planner.memory import CPU_COMPILER_OPTIONS, shard_bytes
from jlong.planner.pricing import Efficiency
from jlong.planner.step_cost import ESTIMATE_NOTE, estimate
from jlong.planner.targets import GIB, GPUS, PlanTarget
from jlong.program.train_program import TrainProgram


@dataclasses.dataclass(frozen=True)
class GenerationPlan:
    """Bytes per device, seconds estimated (None on the cpu target)."""

    target: str
    compiler: str
    prompt_tokens: int
    new_tokens: int
    batch: int  # sequences generated together: the prompts (padded to whole rows of data x fsdp) x their samples
    padded_length: int  # P, the prefill's length
    samples: int  # completions per prompt, sharing its prefill
    parameters: int
    cache: int  # every cache after the prefill, the new tokens' slots included
    prefill_peak: int  # the prefill program's arguments and temporaries
    decode_peak: int  # a decode call's
    budget: int
    prefill_s: float | None = None
    decode_step_s: float | None = None  # one new token for every sequence
    decode_floor_s: float | None = None  # every weight and cache byte of a device read once from HBM
    longest_prompt: int | None = None  # the longest prompt (with new_tokens) whose programs fit the budget
    whole_weights: bool = False  # decoding with the compute-dtype weights whole on each device (`Sampler`)

    @property
    def device_total(self) -> int:
        return max(self.prefill_peak, self.decode_peak)

    @property
    def fits(self) -> bool:
        return self.device_total <= self.budget

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.batch / self.decode_step_s if self.decode_step_s else None

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "program": "generate", "device_total": self.device_total,
                "fits": self.fits, "decode_tokens_per_s": self.decode_tokens_per_s,
                "cost_note": ESTIMATE_NOTE if self.prefill_s is not None else None}


def plan_generation(config: Config, target: PlanTarget, *, prompt_tokens: int, new_tokens: int, batch: int,
                    samples: int = 1, efficiency: Efficiency = Efficiency(), search: bool = True) -> GenerationPlan:
    """The plan of generating `new_tokens` after prompts of `prompt_tokens`, `batch` of them together and
    `samples` completions of each (sharing its prefill), with the longest prompt that fits (unless not `search`)."""
    for name, value in (("--prompt-tokens", prompt_tokens), ("--new-tokens", new_tokens), ("--batch", batch)):
        if value < 1:
            raise JlongError(f"{name} must be at least 1, got {value}")
    if prompt_tokens + new_tokens > config.train.seq_len:
        raise JlongError(f"--prompt-tokens {prompt_tokens:,} and --new-tokens {new_tokens:,} pass train.seq_len "
                         f"({config.train.seq_len:,}), the length the config plans for: raise train.seq_len")
    planned = _plan_at(config, target, prompt_tokens, new_tokens, batch, efficiency, samples)
    if not search:
        return planned
    return dataclasses.replace(planned, longest_prompt=_longest_prompt(config, target, planned, efficiency))


def _plan_at(config, target, prompt_tokens, new_tokens, batch, efficiency, samples=1) -> GenerationPlan:
    on_cpu = not target.is_gpu
    if on_cpu:  # bfloat16 as float16, which XLA:CPU does not widen (`jlong.planner.memory`)
        swap = {"bfloat16": "float16"}
        config = with_values(config, train={key: swap.get(getattr(config.train, key), getattr(config.train, key))
                                            for key in ("param_dtype", "compute_dtype")})
    program = TrainProgram(config, make_mesh(config.mesh, target.devices(config.mesh.size)))
    budget = int(target.device_budget_gib(config.train.gpu_memory_fraction) * GIB)
    itemsize = jnp.dtype(config.train.compute_dtype).itemsize
    whole = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(program.abstract_params)) * itemsize
    sampler = Sampler(program, whole_weights=whole <= WHOLE_WEIGHTS_SHARE * budget)
    P = sampler.padded_length(prompt_tokens, new_tokens)
    rows = -(-batch // sampler.rows_multiple) * sampler.rows_multiple
    prompts = PromptBatch.of([[0] * prompt_tokens] * rows, P)
    sharding = compute_sharding(program.mesh, ("batch", "seq"))
    arrays = {key: jax.ShapeDtypeStruct(value.shape, np.int32, sharding=sharding)
              for key, value in prompts.arrays().items() if key != "slot_positions"}
    prefill = sampler.prefill_program(P)
    caches, logits = jax.eval_shape(prefill, program.abstract_params, arrays)
    host = sampler.host_rows(prompts, Request(new_tokens, num_samples=samples), list(range(rows)), rows)
    state = jax.eval_shape(sampler.initial_state, caches, logits, host)
    state = jax.tree.map(lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), state,
                         sampler.state_shardings(state))
    weights = jax.eval_shape(sampler.decode_weights, program.abstract_params)
    compiled = [_compile(lowered, on_cpu) for lowered in (
        prefill.lower(program.abstract_params, arrays),
        sampler.decode.lower(weights, state, STEPS_PER_CALL, samples))]
    parameters = shard_bytes(program.abstract_params)
    held_beside = parameters if sampler.whole_weights else 0  # the weights' own shards, beside the whole copy
    plan = GenerationPlan(
        target=target.name, compiler=target.compiler(), prompt_tokens=prompt_tokens, new_tokens=new_tokens,
        batch=rows * samples, padded_length=P, samples=samples, parameters=parameters, cache=shard_bytes(state["caches"]),
        prefill_peak=_peak(compiled[0], donated=False), decode_peak=_peak(compiled[1], donated=True) + held_beside,
        budget=budget, whole_weights=sampler.whole_weights)
    if on_cpu:
        return plan
    gpu = GPUS[target.name]
    node_of = [device.process_index for device in program.mesh.devices.flat]
    devices = len(node_of)
    forward = model_flops_per_token(with_values(config, train={"seq_len": P})) / 3  # training counts fwd + bwd
    prefill_cost, decode_cost = (
        estimate(parse_module(c.as_text()), gpu=gpu, efficiency=efficiency, node_of=node_of, tokens_per_step=tokens,
                 model_flops_per_device=forward * tokens / devices)
        for c, tokens in ((compiled[0], rows * P), (compiled[1], rows * samples * STEPS_PER_CALL)))
    floor = ((whole if sampler.whole_weights else parameters) + plan.cache) / gpu.hbm_bytes_per_s
    return dataclasses.replace(plan, prefill_s=prefill_cost.step_time_s,
                               decode_step_s=decode_cost.step_time_s / STEPS_PER_CALL, decode_floor_s=floor)


def _compile(lowered, on_cpu: bool):
    if on_cpu:
        return lowered.compile(CPU_COMPILER_OPTIONS)
    # A compile-only GPU executable cannot be read back from jax's persistent cache: never written there.
    with private("jax._src.config", "persistent_cache_min_compile_time_secs")(float("inf")):
        return lowered.compile()


def _peak(compiled, *, donated: bool) -> int:
    """A program's device bytes: its arguments and temporaries, and outputs not written over donated inputs."""
    analysis = compiled.memory_analysis()
    outputs = analysis.output_size_in_bytes - (analysis.alias_size_in_bytes if donated else 0)
    return analysis.argument_size_in_bytes + analysis.temp_size_in_bytes + max(outputs, 0)


def _longest_prompt(config, target, planned: GenerationPlan, efficiency) -> int | None:
    """The longest prompt whose programs fit the budget, with the plan's new tokens and batch: a line through
    the plan at its length and at twice (or half) it, checked by planning the length it gives (and 5% less,
    twice at most, where that does not fit); None where no length fits."""
    room = config.train.seq_len - planned.new_tokens
    other_length = planned.prompt_tokens * 2 if planned.prompt_tokens * 2 <= room else planned.prompt_tokens // 2
    if other_length < 1 or other_length == planned.prompt_tokens:
        return planned.prompt_tokens if planned.fits else None
    prompts = planned.batch // planned.samples
    other = _plan_at(config, target, other_length, planned.new_tokens, prompts, efficiency, planned.samples)
    slope = (other.device_total - planned.device_total) / (other_length - planned.prompt_tokens)
    if slope <= 0:
        return room if planned.fits else None
    guess = min(room, int(planned.prompt_tokens + (planned.budget - planned.device_total) / slope))
    for _ in range(3):
        if guess < 1:
            return None
        if _plan_at(config, target, guess, planned.new_tokens, prompts, efficiency, planned.samples).fits:
            return guess
        guess = int(guess * 0.95)
    return None


def format_generation_plan(plan: GenerationPlan, config: Config) -> str:
    m = config.mesh
    unit, size = ("GiB", GIB) if plan.device_total >= GIB else ("MiB", 2**20)
    lines = [
        f"target {plan.target}: {plan.compiler}",
        f"generate: {plan.batch // plan.samples} prompt(s) of {plan.prompt_tokens:,} tokens (prefilled at "
        f"{plan.padded_length:,}) x {plan.samples} sample(s), {plan.new_tokens:,} new tokens each, on mesh data={m.data} fsdp={m.fsdp} ring={m.ring} sp={m.sp}; "
        f"{config.train.compute_dtype} compute",
        f"per device                 {unit}",
        *(f"  {name:<24}{value / size:>8.2f}" for name, value in (
            ("parameters", plan.parameters), ("caches", plan.cache), ("prefill peak", plan.prefill_peak),
            ("decode peak", plan.decode_peak))),
    ]
    over = (plan.device_total - plan.budget) / GIB
    verdict = "fits" if plan.fits else f"does NOT fit (over by {over:.2f} GiB)"
    lines.append(f"device budget {plan.budget / GIB:.2f} GiB per device: {verdict}")
    lines.append("decoding with the weights whole on each device (gathered once per call from their shards)"
                 if plan.whole_weights else "decoding gathers each layer's weights from their FSDP shards every step")
    if plan.prefill_s is not None:
        prefill = f"{plan.prefill_s:,.2f} s" if plan.prefill_s >= 1 else f"{plan.prefill_s * 1e3:,.2f} ms"
        lines.append(f"prefill: estimated {prefill}; decode: estimated {plan.decode_step_s * 1e3:,.2f} ms "
                     f"a step ({plan.decode_tokens_per_s:,.1f} tokens/s for the batch), floor "
                     f"{plan.decode_floor_s * 1e3:,.2f} ms (weights and caches read once from HBM); estimates read "
                     "from the compiled programs, not measurements")
    else:
        lines.append("no time estimates on the cpu target: plan for a GPU target (--target h100)")
    if plan.longest_prompt is not None:
        lines.append(f"longest prompt that fits with {plan.new_tokens:,} new tokens: {plan.longest_prompt:,} tokens "
                     f"(train.seq_len {config.train.seq_len:,} allows {config.train.seq_len - plan.new_tokens:,})")
    else:
        lines.append("no prompt length fits the budget")
    return "\n".join(lines)
