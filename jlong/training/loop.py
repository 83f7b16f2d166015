"""The training loop, in three phases: `start` (restore or initialise, then
compile), the steps (update, non-finite check, checkpoint), and a `Recorder`
that owns the metrics, the run directory and the progress bar."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import jax
import numpy as np

from jlong.checkpoint import Checkpoints
from jlong.config import Config, config_to_dict
from jlong.config.stages import StageRun, stage_at, stage_runs
from jlong.data.recorded import with_recorded_data
from jlong.errors import JlongError
from jlong.planner.advice import is_out_of_memory, out_of_memory_error, over_budget_error
from jlong.planner.flops import model_flops_per_token
from jlong.planner.memory import CompiledStep, plan, plan_of
from jlong.planner.memory_choice import resolve_stages
from jlong.planner.targets import DEFAULT_HOST_BUDGET_GIB, GIB, PlanTarget, known_gpu, peak_flops_per_device
from jlong.parallel.placement import make_mesh
from jlong.checkpoint import BASE_DIGEST
from jlong.training.checkpoint_owner import check_lora_base_of, check_owner
from jlong.training.host_memory import available_bytes, check_host_memory
from jlong.lora.peft_format import read_adapters
from jlong.init_from import InitialWeights, check_init_from
from jlong.training.metric_sinks import check_available
from jlong.program.optimizer import learning_rate
from jlong.training.preemption import StopRequests
from jlong.objectives import objective_of
from jlong.program.train_program import TrainProgram
from jlong.training.progress import Progress
from jlong.training.report import nothing_to_do, summary
from jlong.training.routing_watch import RoutingWatch
from jlong.training.run_dir import RunDir


@contextlib.contextmanager
def explained_out_of_memory(config: Config, mesh, where: str):
    """Turns XLA's out-of-memory error into one line with the plan and the fixes."""
    try:
        yield
    except jax.errors.JaxRuntimeError as err:
        if not is_out_of_memory(err):
            raise
        stats = jax.local_devices()[0].memory_stats() or {}
        raise out_of_memory_error(config, where, list(mesh.devices.flat), stats.get("bytes_limit")) from None


def local_value(x: jax.Array) -> float:
    """A replicated scalar's value, readable on every process."""
    return float(np.asarray(x.addressable_data(0)))


@dataclasses.dataclass
class Started:
    """A run ready for its next step."""

    program: TrainProgram
    compiled: jax.stages.Compiled | None  # None when no step is left to run
    params: dict
    opt_state: object
    step: int  # the last step done (0 for a fresh run)
    lora_base: str | None = None  # the digest of a LoRA run's base, which its checkpoints record


def start(config: Config, mesh, checkpoints: Checkpoints | None, last: int,
          initial: InitialWeights | None = None, *, staged: bool = False) -> Started:
    """Restores the newest readable checkpoint into this mesh's shardings (or
    initialises: from `initial` (train.init_from), from hf_path, or from the
    seed), says where the run starts, and compiles the step, when steps up
    to `last` remain (a `staged` run compiles each stage's as it enters it)."""
    program = TrainProgram(config, mesh)
    step, saved, opt_state = 0, None, None
    if checkpoints:  # a LoRA run's checkpoints hold its adapters; its base is read again from where it came
        step, saved, opt_state = checkpoints.restore_newest_readable(
            program.abstract_saved_params, program.abstract_opt_state, say=_say
        )
    if step:
        params = program.with_saved(program.starting_params(), saved) if program.lora else saved
    else:
        initial = initial or check_init_from(config)  # none of the run's checkpoints could be read
        params = program.load_initial_weights(initial) if initial else program.starting_params()
        if program.lora and config.lora.init_from:
            params = program.with_saved(params, program.place_saved(read_adapters(config.lora.init_from, program)))
        opt_state = program.init_opt_state(params)
    compiled = None
    if step < last:
        _say(starting_line(config, step, initial))
        if not staged:
            compiled = _compile(program)
    return Started(program, compiled, params, opt_state, step)


def starting_line(config: Config, step: int, initial: InitialWeights | None = None) -> str:
    """Where a run starts: `resuming step N from DIR`, or step 1 and why."""
    where = config.checkpoint.dir
    if step:
        return f"resuming step {step} from {where}"
    weights = f" from the weights in {config.model.hf_path}" if config.model.hf_path else ""
    weights = f" from {initial.describe()} (a fresh optimizer)" if initial else weights
    if config.lora:
        lora = config.lora
        adapters = f"from the PEFT adapters in {lora.init_from}" if lora.init_from else "fresh"
        base = "4-bit NF4" if lora.base_dtype == "nf4" else config.train.compute_dtype
        weights += f", LoRA rank {lora.rank} on {', '.join(lora.targets)} ({adapters}; the base frozen in {base})"
    why = f"no checkpoint in {where}" if where else "no checkpoint.dir: nothing will be saved to resume from"
    return f"starting at step 1{weights} ({why})"


def _compile(program: TrainProgram) -> jax.stages.Compiled:
    """The train step, compiled, with a line before and after (it can take
    minutes at long lengths); out of memory explained; on a GPU, its host
    bytes checked against the node's free memory."""
    config, mesh = program.config, program.config.mesh
    _say(f"compiling the train step for {mesh.size} devices (data {mesh.data} x fsdp {mesh.fsdp} x ring "
         f"{mesh.ring} x sp {mesh.sp}), {config.train.seq_len:,} tokens per sequence ...")
    began = time.perf_counter()
    with explained_out_of_memory(config, program.mesh, "compiling the train step"):
        compiled = program.compile()
    _say(f"compiled in {time.perf_counter() - began:,.1f} s")
    if config.train.check_host_memory and program.mesh.devices.flat[0].platform == "gpu":
        check_host_memory(host_bytes_per_node(program, compiled), available_bytes())
    return compiled


def host_bytes_per_node(program: TrainProgram, compiled: jax.stages.Compiled) -> int:
    """What the compiled step keeps in host memory on this process's node (the plan's figure)."""
    return plan_of(CompiledStep(program, compiled, PlanTarget(), list(program.mesh.devices.flat))).host_per_node


def run_target(devices) -> PlanTarget:
    """The budgets a run is held to on `devices`: on a GPU, the device's own
    limit and this node's available host memory; the planner's defaults on a CPU."""
    capacity = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")  # another process's: no stats
    gpu = known_gpu(devices[0])
    available = available_bytes() if devices[0].platform == "gpu" else None
    if jax.process_count() > 1:  # every process must choose the same program: the tightest node's budgets
        from jax.experimental import multihost_utils

        capacity, available = (int(v) or None for v in multihost_utils.process_allgather(
            np.array([capacity or 0, available or 0], np.int64)).min(axis=0))
    return PlanTarget(gpu or "cpu", budget_gib=capacity / GIB if capacity else None,
                      host_budget_gib=available / GIB if available else DEFAULT_HOST_BUDGET_GIB,
                      gpus_per_node=max(jax.local_device_count(), 1))


def train(config: Config, *, until_step: int | None = None, stop_requests: StopRequests | None = None) -> list[dict]:
    """Trains to train.steps (or `until_step`), stage by stage when the
    config has `stages`, resuming from the newest checkpoint in
    checkpoint.dir when that directory holds this run's; returns this run's
    metric records. SIGTERM, SIGUSR1 or Ctrl-C (recorded by
    `stop_requests`, by default handlers installed for the call) stops it
    after the step under way, with a checkpoint."""
    config = with_recorded_data(config)  # data.eos_id and data.loss_mask as the token files record them
    last = checked_last_step(config, until_step)
    check_available(config.train.log_to)
    stages = stage_runs(config)
    # Each stage's data and held-out tokens, and the run directory, are checked before anything is built.
    staged = len(stages) > 1
    objective = objective_of(config)
    inputs = {run.number: (objective.batches(run.config), PeriodicEvaluation(run.config, run.last if staged else None))
              for run in stages}
    run_dir = RunDir(config) if config.run_dir and jax.process_index() == 0 else None
    resumable = 0
    if config.checkpoint.dir:
        owner = check_owner(config)
        resumable = owner.newest
        if owner.note:
            _say(owner.note)
    initial = None if resumable else check_init_from(config)  # read only by a run's first session
    lora_base = check_lora_base_of(config, resumable, _say)
    if any(run.config.chooses_layout for run in stages):  # the planner's choice, before anything is built
        devices = jax.devices()
        stages = resolve_stages(stages, run_target(devices), devices, say=_say)
        if run_dir and not staged:
            run_dir.config = config_to_dict(stages[0].config)  # config.yaml records the choice
    stage = stage_at(stages, resumable + 1)
    capacity = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    if staged and capacity and jax.default_backend() == "gpu":
        check_stages_fit([run for run in stages if run.last > resumable], jax.devices(), capacity)
    checkpoints = Checkpoints(config.checkpoint.dir, config.checkpoint.keep,
                              run_record=config_to_dict(config)) if config.checkpoint.dir else None
    stops = stop_requests or StopRequests.installed()
    try:
        # Before any weights are on the devices: DPO's reference policy needs no second copy of them.
        objective.before_training([(each.config, inputs[each.number][0]) for each in stages], _say,
                                  lambda each: TrainProgram(each, make_mesh(each.mesh)))
        run = start(stage.config, make_mesh(stage.config.mesh), checkpoints, last, initial, staged=staged)
        if run.step and checkpoints:  # what the objective keeps beside the weights (GRPO's pending rollouts)
            objective.restore_state(inputs[stage.number][0], checkpoints.meta(run.step))
        run.lora_base = lora_base
        if run.step >= last:
            _say(nothing_to_do(config, run.step, until_step))
            return []
        if run_dir:
            for line in run_dir.start(resumed_at=run.step):
                _say(line)
            if run.step and run_dir.relaid:
                _say(f"the layout changed since step {run.step}: {'; '.join(run_dir.relaid)}")
        began, stopped_by = time.perf_counter(), None
        routing = routing_watch(config)
        with Recorder(config, run_dir, first=run.step, last=last) as recorder:
            for step in range(run.step + 1, last + 1):
                stopped_by = stops.agreed()
                if stopped_by:
                    break
                stage = stage_at(stages, step)
                if run.program.config is not stage.config or run.compiled is None:
                    _enter_stage(run, stage, len(stages))
                batches, evaluation = inputs[stage.number]
                stops.step_started(step, recorder.expected_step_seconds())
                batch = objective.batch(batches, step, run.program, run.params)
                loss, grad_norm, model_metrics, seconds = _update(run, batch, step)
                _check_finite(step, loss, grad_norm, checkpoints)
                objective.after_step(run.program, run.params, step, _say)
                if routing and (warning := routing.observe(step, model_metrics)):
                    _say(warning)
                measured = {**model_metrics, "trained_tokens": trained_tokens(batch), **batches.drawn(step),
                            **evaluation.at(step, run.program, run.params)}
                recorder.record(step, loss, grad_norm, seconds, {"stage": stage.number, **measured} if staged
                                else measured, stage.config)
                every = config.checkpoint.every
                if checkpoints and ((every and step % every == 0) or step == last):
                    _save(stage.config, checkpoints, run, stage.number if staged else None,
                          objective.saved_state(batches, step))
        if run_dir and recorder.records:
            run_dir.plot_losses()
        if stopped_by:
            _say(_stop(stage.config, checkpoints, run, stopped_by,
                       objective.saved_state(inputs[stage.number][0], run.step)))
        else:
            _say(summary(config, recorder.records, time.perf_counter() - began, last if checkpoints else None))
        return recorder.records
    finally:
        if stop_requests is None:
            stops.uninstall()
        if run_dir:
            run_dir.close()
        if checkpoints:
            checkpoints.close()


def routing_watch(config: Config) -> RoutingWatch | None:
    """The watch for collapsed routing of a mixture of experts (None for other models)."""
    model = config.model
    if not model.num_experts:
        return None
    return RoutingWatch(model.num_experts, model.num_experts_per_tok, model.router_aux_loss_coef,
                        config.train.router_aux_loss)


def check_stages_fit(stages: list[StageRun], devices, budget_bytes: int) -> None:
    """Plans every stage's step on the run's devices and refuses, before step
    1, a stage whose plan is over `budget_bytes` per device (the GPUs' pool)."""
    target = PlanTarget(budget_gib=budget_bytes / GIB)
    for stage in stages:
        result = plan(stage.config, target, devices=devices)
        if not result.fits_device:
            error = over_budget_error(result, stage.config)
            raise JlongError(f"stage {stage.number} (steps {stage.first}-{stage.last}) does not fit: {error}")


def _enter_stage(run: Started, stage: StageRun, count: int) -> None:
    """Moves the run's parameters and optimizer state into the stage's program (its length, mesh, memory
    settings) and compiles its step."""
    config = stage.config
    _say(f"stage {stage.number} of {count}: steps {stage.first}-{stage.last} at seq_len {config.train.seq_len:,}")
    if run.program.config is not config:
        program = TrainProgram(config, make_mesh(config.mesh))
        run.params = jax.device_put(run.params, program.rest_shardings)
        run.opt_state = jax.device_put(run.opt_state, program.opt_shardings)
        run.program = program
    run.compiled = _compile(run.program)


def checked_last_step(config: Config, until_step: int | None) -> int:
    """The last step to run: train.steps, or `until_step` when it comes first."""
    if until_step is None:
        return config.train.steps
    if until_step < 1:
        raise JlongError(f"until_step must be a step of the run (1 to train.steps={config.train.steps}), "
                         f"got {until_step}", "until_step")
    return min(config.train.steps, until_step)


class PeriodicEvaluation:
    """train.eval_every: the loss by position on eval.path (or eval.mix), with the run's
    parameters and forward pass, every that many steps; and, in a run in
    stages, at each stage's last step, the loss by position and passkey
    retrieval at the stage's length. The held-out file and the passkey
    prompts are read (and checked) when this is made, before anything compiles."""

    def __init__(self, config: Config, stage_last: int | None = None):
        from jlong.eval.evaluate import held_out_rows, passkey_trials

        self.every, self.evaluator = config.train.eval_every, None
        self.stage_last = stage_last if config.eval.held_out else None
        self.rows = held_out_rows(config) if self.every or self.stage_last else None
        self.trials = passkey_trials(config) if self.stage_last else []

    def at(self, step: int, program: TrainProgram, params: dict) -> dict:
        """The metrics to log with step `step` (none between evaluations)."""
        stage_ends = step == self.stage_last
        if not stage_ends and (not self.every or step % self.every):
            return {}
        from jlong.eval.evaluate import Evaluator, passkey_accuracy, position_losses

        self.evaluator = self.evaluator or Evaluator(program)
        result = position_losses(self.evaluator, params, self.rows)
        metrics = {"eval_loss": result["loss"], "eval_loss_by_position": result["loss_by_position"]}
        if "loss_by_source" in result:
            metrics["eval_loss_by_source"] = result["loss_by_source"]
        if stage_ends and self.trials:
            metrics["eval_passkey"] = passkey_accuracy(self.evaluator, params, self.trials)
        return metrics


def _save(config: Config, checkpoints: Checkpoints, run: Started, stage: int | None = None,
          objective_state: dict | None = None) -> None:
    # The data position, the RNG and the stage are functions of the step and the config; kept for readers.
    # What the objective keeps (GRPO's pending rollouts) is not: the resumed run takes it back.
    extra = {"samples_seen": run.step * config.train.batch_size, "seed": config.train.seed, **(objective_state or {})}
    if stage is not None:
        extra["stage"] = stage
    if config.lora:  # the adapters alone are saved: what they adapt, for resuming and `jlong convert`
        extra["lora"] = {**config.lora.model_dump(mode="json"), "hf_path": config.model.hf_path,
                         BASE_DIGEST: run.lora_base}
    checkpoints.save(run.step, run.program.saved(run.params), run.opt_state, model=config.model, extra=extra)


def _stop(config: Config, checkpoints: Checkpoints | None, run: Started, signal, objective_state: dict) -> str:
    """Saves the step the run stopped at, unless saved already; the line that says so."""
    if not run.step:
        return f"stopped on {signal.name} before the first step; nothing to save"
    stopped = f"stopped at step {run.step} on {signal.name}"
    if not checkpoints:
        return f"{stopped}; no checkpoint.dir is set, so nothing was saved"
    if checkpoints.latest_step() != run.step:
        _save(config, checkpoints, run, objective_state=objective_state)
    return f"{stopped}; checkpoint saved in {config.checkpoint.dir} (the same command resumes)"


def _say(text: str) -> None:
    """Printed once, by the first process."""
    if jax.process_index() == 0:
        print(text, flush=True)


def trained_tokens(batch: dict[str, np.ndarray]) -> int:
    """The target tokens of a global batch that count in its loss."""
    return int(batch["loss_mask"].sum()) if "loss_mask" in batch else int(batch["targets"].size)


def _update(run: Started, batch: dict[str, np.ndarray], step: int) -> tuple[float, float, dict[str, float], float]:
    """One optimizer step on `run` with the global `batch`: (loss, grad_norm, the model's other metrics, seconds)."""
    program = run.program
    batch = program.place_batch(batch)
    began = time.perf_counter()
    with explained_out_of_memory(program.config, program.mesh, f"at step {step}"):
        run.params, run.opt_state, metrics = run.compiled(run.params, run.opt_state, batch)
        values = {name: local_value(value) for name, value in metrics.items()}
    run.step = step
    loss, grad_norm = values.pop("loss"), values.pop("grad_norm")
    return loss, grad_norm, values, time.perf_counter() - began


def _check_finite(step: int, loss: float, grad_norm: float, checkpoints: Checkpoints | None) -> None:
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    good = checkpoints.latest_step() if checkpoints else None
    kept = f"; the last good checkpoint is step {good}" if good else ""
    raise JlongError(
        f"step {step}: loss {loss} / grad_norm {grad_norm} is not finite, training stopped "
        f"(lower train.lr or raise train.warmup_steps){kept}"
    )


class Recorder:
    """Each step's metrics (with throughput, MFU on GPUs, peak device memory)
    into the records, run_dir/metrics.jsonl and the progress display; and the
    profiler window of train.profile_*."""

    def __init__(self, config: Config, run_dir: RunDir | None, *, first: int, last: int):
        self.config, self.run_dir = config, run_dir
        self.records: list[dict] = []
        self.peak_flops = (peak_flops_per_device() or 0.0) * jax.device_count()
        self.progress = Progress(first=first, last=last, enabled=jax.process_index() == 0)
        self.eval_loss: float | None = None  # the latest evaluation's, shown until the next
        self.profiler = ProfileWindow(config)
        self.profiler.at_step(first + 1)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *_) -> None:
        self.profiler.stop()
        self.progress.close()

    def expected_step_seconds(self) -> float | None:
        """How long the next step should take: the last one's time (None before any)."""
        return self.records[-1]["step_time_s"] if self.records else None

    def record(self, step: int, loss: float, grad_norm: float, seconds: float, evaluation: dict,
               stage: Config | None = None) -> None:
        """Step `step`'s metrics; `stage` is the config it ran with (the run's own, or its stage's)."""
        train = (stage or self.config).train
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": float(learning_rate(train, step)),
            "seq_len": train.seq_len,
            "tokens_per_s": train.batch_size * train.seq_len / seconds,
            "step_time_s": seconds,
        }
        flops_per_token = model_flops_per_token(stage or self.config)  # a LoRA run's: no base weight gradients
        record.update(device_memory(), **mfu(record["tokens_per_s"], flops_per_token, self.peak_flops),
                      **evaluation)
        self.records.append(record)
        if self.run_dir:
            self.run_dir.log(record)
        self.eval_loss = record.get("eval_loss", self.eval_loss)
        shown = {"loss": f"{loss:.4f}"}
        if self.eval_loss is not None:
            shown["eval_loss"] = f"{self.eval_loss:.4f}"
        shown["tok/s"] = f"{record['tokens_per_s']:,.0f}"
        self.progress.advance(step, shown)
        self.profiler.at_step(step + 1)


class ProfileWindow:
    """A jax.profiler trace of steps [profile_start, profile_start + profile_steps)
    into run_dir/profile (process 0 only)."""

    def __init__(self, config: Config):
        train = config.train
        self.first, self.end = train.profile_start, train.profile_start + train.profile_steps
        self.enabled = bool(train.profile_steps) and jax.process_index() == 0
        self.directory = f"{config.run_dir}/profile"
        self.tracing = False

    def at_step(self, step: int) -> None:
        """Called before step `step` runs."""
        if self.enabled and step == self.first:
            jax.profiler.start_trace(self.directory)
            self.tracing = True
        elif self.tracing and step == self.end:
            self.stop()

    def stop(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False


def device_memory() -> dict:
    """Peak bytes in use on this process's first device (GPU; absent on CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return {}
    return {"peak_bytes": int(stats["peak_bytes_in_use"])}


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float | None) -> dict:
    if not peak_flops:
        return {}
    return {"mfu": tokens_per_s * flops_per_token / peak_flops}
