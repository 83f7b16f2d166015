"""The training loop: data, compiled step, metrics, checkpoints, resume."""

from __future__ import annotations

import contextlib
import math
import time

import jax
import numpy as np
from tqdm import tqdm

from jlong.checkpoint import Checkpoints
from jlong.config import Config
from jlong.data.sources import Batches
from jlong.errors import JlongError
from jlong.parallel.mesh import batch_sharding, make_mesh
from jlong.train.flops import model_flops_per_token, peak_flops_per_device
from jlong.train.oom import is_out_of_memory, out_of_memory_error
from jlong.train.optimizer import learning_rate, make_optimizer
from jlong.train.run_dir import RunDir
from jlong.train.state import Model
from jlong.train.step import make_train_step, opt_state_layout


def place_batch(batch: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
    """The global numpy batch -> arrays sharded over the mesh (each process
    builds only the shards its devices hold)."""
    sharding = batch_sharding(mesh)
    return {
        key: jax.make_array_from_callback(value.shape, sharding, lambda index, v=value: v[index])
        for key, value in batch.items()
    }


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


def train(config: Config, *, until_step: int | None = None) -> list[dict]:
    """Trains to train.steps (or `until_step`), resuming from the newest
    checkpoint in checkpoint.dir; returns this run's metric records."""
    last = min(config.train.steps, until_step or config.train.steps)
    is_main = jax.process_index() == 0
    mesh = make_mesh(config.mesh)
    batches = Batches(config)  # validates the data before anything compiles
    run_dir = RunDir(config) if config.run_dir and is_main else None

    model = Model(config, mesh)
    optimizer = make_optimizer(config.train)
    opt_shardings, abstract_opt_state = opt_state_layout(optimizer, model)
    checkpoints = Checkpoints(config.checkpoint.dir, config.checkpoint.keep) if config.checkpoint.dir else None
    start = (checkpoints.latest_step() or 0) if checkpoints else 0
    if start:
        params, opt_state = checkpoints.restore(start, model.abstract_params(), abstract_opt_state)
    else:
        hf_path = config.model.hf_path
        params = model.load_hf_params(hf_path) if hf_path else model.init_params(config.train.seed)
        opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    if run_dir:
        run_dir.start(resumed_at=start)

    tokens_per_step = config.train.batch_size * config.train.seq_len
    flops_per_token = model_flops_per_token(config.model, config.train.seq_len)
    peak_flops = (peak_flops_per_device() or 0.0) * jax.device_count()
    train_step = make_train_step(model, optimizer, opt_shardings)
    records = []
    progress = tqdm(total=last, initial=start, disable=not is_main, desc="train", unit="step")
    compiled = None
    profiler = ProfileWindow(config)
    try:
        for step in range(start + 1, last + 1):
            batch = place_batch(batches.batch(step), mesh)
            with explained_out_of_memory(config, mesh, "compiling the train step"):
                if compiled is None:
                    compiled = train_step.lower(params, opt_state, batch).compile()
            profiler.at_step(step)
            began = time.perf_counter()
            with explained_out_of_memory(config, mesh, f"at step {step}"):
                params, opt_state, metrics = compiled(params, opt_state, batch)
                loss, grad_norm = local_value(metrics["loss"]), local_value(metrics["grad_norm"])
            seconds = time.perf_counter() - began
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                good = checkpoints.latest_step() if checkpoints else None
                kept = f"; the last good checkpoint is step {good}" if good else ""
                raise JlongError(
                    f"step {step}: loss {loss} / grad_norm {grad_norm} is not finite, training stopped "
                    f"(lower train.lr or raise train.warmup_steps){kept}"
                )
            record = {
                "step": step,
                "loss": loss,
                "grad_norm": grad_norm,
                "lr": float(learning_rate(config.train, step)),
                "tokens_per_s": tokens_per_step / seconds,
                "step_time_s": seconds,
            }
            record.update(device_memory(), **mfu(record["tokens_per_s"], flops_per_token, peak_flops))
            records.append(record)
            if run_dir:
                run_dir.log(record)
            progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            progress.update(1)
            every = config.checkpoint.every
            if checkpoints and ((every and step % every == 0) or step == last):
                # The data position and RNG are functions of the step and seed; kept for readers.
                extra = {"samples_seen": step * config.train.batch_size, "seed": config.train.seed}
                checkpoints.save(step, params, opt_state, model=config.model, extra=extra)
    finally:
        profiler.stop()
        progress.close()
        if checkpoints:
            checkpoints.close()
    return records


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
