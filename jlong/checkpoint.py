"""Training checkpoints (orbax) and conversion to and from Hugging Face.

A checkpoint directory holds one sub-directory per saved step. orbax writes
each into a temporary directory and renames it when complete, so a crash at
any moment leaves the previous complete checkpoint as the newest one.
Each step holds `params`, `opt_state` (absent in converted checkpoints) and
`meta` (the step and the model architecture).

A run resumes from the newest checkpoint that reads back: one that does not
(a file lost, truncated or changed after it was written, found by comparing
the files with the sizes and checksums listed when they were written
(`jlong.checkpoint_integrity`), or failing to read) is moved aside to
`STEP.unreadable`, never deleted, and the next older one is tried. A write
that fails stops the run, removes what it began and leaves the previous
checkpoints as they were; why it failed is kept beside them
(`jlong_failed_save.json`) for the next run to say, until a save succeeds.

Beside the steps, `jlong_run.yaml` records the config of the run that writes
there, so that another run can be told apart before it resumes or deletes
anything (`jlong.training.checkpoint_owner`).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import orbax.checkpoint as ocp
import yaml
from etils import epath

from jlong.checkpoint_integrity import find_damage, has_checksums, record_files, saved_steps
from jlong.config import ModelConfig, model_config
from jlong.errors import JlongError, RunFailure
from jlong.files import free_name, write_atomically
from jlong.jax_startup import quiet_native_stderr

# In a LoRA run's checkpoint meta, beside its lora section: where its base was read, and that base's digest.
BASE_DIGEST = "base_digest"
LORA_BASE_KEYS = ("hf_path", BASE_DIGEST)
RUN_RECORD = "jlong_run.yaml"  # in the checkpoint directory: the config of the run that writes there
FAILED_SAVE = "jlong_failed_save.json"  # in the checkpoint directory: the step and cause of a save that failed
# How long a failed read or write waits for orbax's other threads to finish reporting it.
_SETTLE_SECONDS = 1.0


def read_run_record(directory: str | Path) -> dict | None:
    """The config recorded by the run that writes into `directory` (None: no record)."""
    path = Path(directory) / RUN_RECORD
    if not path.is_file():
        return None
    try:
        record = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise JlongError(f"{str(path)!r} cannot be read ({err}); restore it, or choose a new checkpoint.dir") from None
    if not isinstance(record, dict):
        raise JlongError(f"{str(path)!r} is not a config record; restore it, or choose a new checkpoint.dir")
    return record


def weights_kind(path: str | Path, setting: str) -> str:
    """"hf" (a Hugging Face directory) or "jlong" (a checkpoint directory),
    checked before anything is built; `setting` names it in the messages."""
    path = Path(path)
    if not path.is_dir():
        raise JlongError(f"{setting} {str(path)!r} is not a directory")
    if (path / "config.json").is_file():
        return "hf"
    if not saved_steps(path):
        raise JlongError(f"{setting} {str(path)!r} holds no jlong checkpoint (nor a Hugging Face config.json)")
    return "jlong"


class Checkpoints:
    def __init__(self, directory: str | Path, keep: int = 2, *, run_record: dict | None = None):
        """`run_record`: the config of the run that saves here, written beside
        its steps before its first save (a reader passes none)."""
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self.failed = False
        self.run_record = run_record

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params, opt_state=None, *, model: ModelConfig, extra: dict | None = None):
        import jax

        items = {
            "params": ocp.args.StandardSave(params),
            "meta": ocp.args.JsonSave({"step": step, "model": model.model_dump(), **(extra or {})}),
        }
        if opt_state is not None:
            items["opt_state"] = ocp.args.StandardSave(opt_state)
        previous, failure = self.latest_step(), None
        if self.run_record is not None:
            self._write_run_record()
        # A failed write is reported by each of orbax's writer threads, with tracebacks; the run says it once.
        with _silenced():
            try:
                self.manager.save(step, args=ocp.args.Composite(**items), force=True)
                self.manager.wait_until_finished()
            except Exception as err:  # orbax and tensorstore raise plain Exception and ValueError for I/O errors
                failure = err
                time.sleep(_SETTLE_SECONDS)
        if failure is not None:
            self.failed = True
            self._clean_up_failed_save(step, failure)
            kept = f"step {previous} is intact" if previous is not None else "no earlier checkpoint exists"
            raise RunFailure(
                f"writing the checkpoint of step {step} to {str(self.directory)!r} failed ({_reason(failure)}); "
                f"{kept}. {_remedy(failure, resumable=previous is not None)}"
            ) from None
        try:
            self._list_files(step)
        except OSError as err:
            raise RunFailure(f"listing the files of checkpoint step {step} in {str(self.directory)!r} failed ({err}); "
                             f"the step is written but will be read unchecked. {_remedy(err, resumable=True)}") from None
        if jax.process_index() == 0:
            (self.directory / FAILED_SAVE).unlink(missing_ok=True)

    def _write_run_record(self) -> None:
        import jax

        if jax.process_index() == 0:
            write_atomically(self.directory / RUN_RECORD, yaml.safe_dump(self.run_record, sort_keys=False))
        self.run_record = None  # once per session

    def _clean_up_failed_save(self, step: int, failure: Exception) -> None:
        """Removes the failed step's temporary directory and records why it
        failed, for the next run to say (both as far as the disk allows)."""
        import jax

        if jax.process_index() != 0:
            return
        for temporary in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(temporary, ignore_errors=True)
        record = {"step": step, "cause": _reason(failure), "machine": _system_cause(failure) is not None}
        with contextlib.suppress(OSError):
            write_atomically(self.directory / FAILED_SAVE, json.dumps(record))

    def _list_files(self, step: int) -> None:
        """Each process lists the size and checksum of each file it wrote
        into the step, so that one damaged later is found before orbax reads it."""
        import jax

        record_files(self.directory / str(step), jax.process_index(), jax.process_count())
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"jlong: listed the files of checkpoint {step}")

    def _damage(self, step: int) -> str | None:
        """The first file of the step that differs from what was written (None:
        none, or nothing recorded). Each process checks a share; all name the same file."""
        import jax

        step_dir, readers = self.directory / str(step), jax.process_count()
        damage = find_damage(step_dir, jax.process_index(), readers)
        if readers == 1:
            return damage
        from jax.experimental import multihost_utils

        found = np.asarray(multihost_utils.process_allgather(np.array(damage is not None))).reshape(-1)
        if not found.any():
            return None
        first = int(np.argmax(found))
        return damage if first == jax.process_index() else find_damage(step_dir, first, readers)

    def failed_save_note(self, resumed: int) -> str | None:
        """One line on a save that failed here since the last that succeeded (None: none did)."""
        try:
            failed = json.loads((self.directory / FAILED_SAVE).read_text())
            step, cause, machine = failed["step"], failed["cause"], failed["machine"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        where = f"resumes step {resumed}" if resumed else "starts again at step 1"
        said = f"the last run in {str(self.directory)!r} failed to write its checkpoint of step {step} ({cause})"
        if machine:
            return f"{said}; this run {where}"
        return (f"{said}, not for lack of space or permissions; this run {where} and will likely fail the same way "
                f"at that checkpoint")

    def meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, step: int, abstract_params, abstract_opt_state=None, say: Callable[[str], None] | None = None):
        """(params, opt_state) of step `step`, refused in one line when a file
        of it changed after it was written (checked before anything is read);
        a step whose files were never listed is said through `say` (by
        default on stderr) and read unchecked."""
        damage = self._damage(step)
        if damage:
            raise JlongError(f"checkpoint step {step} in {str(self.directory)!r} is damaged ({damage}); nothing was "
                             f"read from it ('jlong verify {self.directory}' checks every step)")
        if not has_checksums(self.directory / str(step)):
            (say or stderr_note)(self._unchecked(step))
        return self._restore(step, abstract_params, abstract_opt_state)

    def _unchecked(self, step: int) -> str:
        return (f"checkpoint step {step} in {str(self.directory)!r} has no checksums of its files (written before "
                "jlong kept them, or its save was cut short): restored without checking its bytes")

    def _restore(self, step: int, abstract_params, abstract_opt_state=None):
        items = {"params": ocp.args.StandardRestore(abstract_params)}
        if abstract_opt_state is not None:
            items["opt_state"] = ocp.args.StandardRestore(abstract_opt_state)
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        return restored["params"], restored.get("opt_state") if abstract_opt_state is not None else None

    def restore_newest_readable(self, abstract_params, abstract_opt_state, say) -> tuple[int, object, object]:
        """(step, params, opt_state) of the newest checkpoint that reads back
        into the given shardings, or (0, None, None) when there is none.
        Unreadable ones are moved aside, each reported by `say` in one line
        that names its damaged file and the step the run resumes from; a
        step restored unchecked (written before checksums were kept) and a
        save that failed here before are said too."""
        wanted = {"params": abstract_params, "opt_state": abstract_opt_state}
        trained = [step for step in self.manager.all_steps() if step > 0]  # step 0: converted weights, no state
        set_aside = []
        for step in sorted(trained, reverse=True):
            restored = self._read(step, wanted)
            if isinstance(restored, tuple):
                self._say_set_aside(set_aside, f"resuming from step {step}", say)
                if not has_checksums(self.directory / str(step)):
                    say(self._unchecked(step))
                if note := self.failed_save_note(step):
                    say(note)
                return step, *restored
            set_aside.append((step, restored, self._move_aside(step)))
        self._say_set_aside(set_aside, "no older step can be read", say)
        if any(self.directory.glob("*.unreadable")):
            raise JlongError(f"no checkpoint in {str(self.directory)!r} can be read (see the *.unreadable "
                             "directories there); restore one, or choose a new checkpoint.dir to start over")
        if note := self.failed_save_note(0):
            say(note)
        return 0, None, None

    def _say_set_aside(self, set_aside: list[tuple[int, str, Path]], outcome: str, say) -> None:
        for step, why, aside in set_aside:
            say(f"checkpoint step {step} in {str(self.directory)!r} cannot be read ({why}); "
                f"moved it to {aside.name}, {outcome}")

    def _read(self, step: int, wanted: dict) -> tuple | str:
        """(params, opt_state) of step `step`, or why they cannot be read."""
        import jax

        damage = self._damage(step)
        if damage:
            return damage
        # A damage the file list does not show is reported by each of orbax's readers, with tracebacks,
        # and again as their coroutines are collected; the caller says it once.
        with _silenced():
            try:
                self.check_layout(step, wanted, "a changed model, train.param_dtype or memory.optimizer_offload: "
                                  "resume with the settings it was written with, or choose a new checkpoint.dir")
                return self._restore(step, wanted["params"], wanted["opt_state"])
            except (JlongError, jax.errors.JaxRuntimeError):  # the config's fault, or the devices'
                raise
            except Exception as err:  # tensorstore reports a damaged file as a plain Exception
                reason = _reason(err)
            time.sleep(_SETTLE_SECONDS)  # the other readers finish failing, into the silenced stderr
            gc.collect()
        return reason

    def check_layout(self, step: int, wanted: dict, remedy: str) -> None:
        """Refuses a checkpoint whose arrays' names, shapes or dtypes differ
        from `wanted` (item name -> abstract tree; None: not wanted), in one
        line that names the first difference and then `remedy`."""
        for item, abstract in wanted.items():
            if abstract is None:
                continue
            saved = _layout(ocp.StandardCheckpointHandler().metadata(epath.Path(self.directory / str(step) / item)))
            configured = _layout(abstract)
            if saved != configured:
                first = min(saved.keys() ^ configured.keys() or
                            {k for k in saved if saved[k] != configured[k]})
                detail = (f"{first}: {_shape(saved.get(first))} saved, {_shape(configured.get(first))} configured")
                raise JlongError(
                    f"checkpoint step {step} in {str(self.directory)!r} holds {item} of another layout than this "
                    f"config makes ({detail}); {remedy}"
                )

    def _move_aside(self, step: int) -> Path:
        """Renames step `step`'s directory to one orbax does not read as a step."""
        import jax
        from jax.experimental import multihost_utils

        original = self.directory / str(step)
        aside = free_name(original.with_name(f"{step}.unreadable"))
        if jax.process_index() == 0:
            original.rename(aside)
        multihost_utils.sync_global_devices(f"jlong: moved checkpoint {step} aside")
        self.manager.reload()
        return aside

    def close(self):
        if not self.failed:  # after a failed write, closing would wait on writer threads that went wrong
            self.manager.close()


def stderr_note(text: str) -> None:
    """A note on stderr, from the first process."""
    import jax

    if jax.process_index() == 0:
        print(f"jlong: note: {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _silenced():
    """orbax's threads print their tracebacks to sys.stderr or to file descriptor 2: both go nowhere."""
    with quiet_native_stderr(), contextlib.redirect_stderr(io.StringIO()):
        yield


def _layout(tree) -> dict:
    """Each array's path (named alike whether a level is a dict, a tuple or a
    named tuple: orbax reads named tuples back as dicts) -> shape and dtype."""
    import jax

    def name(key):
        for attribute in ("key", "name", "idx"):
            if hasattr(key, attribute):
                return str(getattr(key, attribute))
        return str(key)

    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {"/".join(map(name, path)): (tuple(leaf.shape), str(leaf.dtype)) for path, leaf in leaves}


def _shape(entry: tuple | None) -> str:
    """'bfloat16[256, 96]' of a layout entry; 'nothing' for none."""
    if entry is None:
        return "nothing"
    shape, dtype = entry
    return f"{dtype}[{', '.join(map(str, shape))}]"


# What the user can do about a write that failed for a reason of the machine (the system's error numbers).
_FIXES = {
    **dict.fromkeys((errno.ENOSPC, errno.EDQUOT, errno.EFBIG), "Free space there (or raise the quota or the file "
                    "size limit)"),
    **dict.fromkeys((errno.EACCES, errno.EPERM, errno.EROFS), "Make the directory writable"),
    errno.EIO: "Check the disk",
    **dict.fromkeys((errno.EMFILE, errno.ENFILE), "Raise the limit on open files (ulimit -n)"),
}


def _system_cause(err: Exception) -> int | None:
    """The system's error number behind a failed write, if it is one of the
    machine's (tensorstore names it only in its message: `[OS error: File too large]`)."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in _FIXES:
            return err.errno
        named = [code for code in _FIXES if os.strerror(code) in str(err)]
        if named:
            return named[0]
        err = err.__cause__ or err.__context__
    return None


def _remedy(failure: Exception, *, resumable: bool) -> str:
    """What to do about a failed write: the machine's cause to fix, or jlong's to report."""
    cause = _system_cause(failure)
    if cause is None:
        return ("No lack of space or permissions was reported: most likely a fault in what jlong wrote, which a "
                "rerun would meet again; please report it as a jlong bug, with this line")
    return f"{_FIXES[cause]}, then run again{' to resume' if resumable else ''}"


def _reason(err: Exception) -> str:
    """The first line of the innermost error (tensorstore's, naming the file and
    the system's reason, under orbax's); of a long one, the end, where the reason is."""
    while (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__
    lines = str(err).strip().splitlines()
    if not lines:
        return type(err).__name__
    return lines[0] if len(lines[0]) <= 240 else "..." + lines[0][-200:]


def convert(source: str | Path, destination: str | Path, *, param_dtype: str = "float32",
            merge: bool = False, say: Callable[[str], None] = print) -> list[Path]:
    """Hugging Face directory -> jlong checkpoint, or jlong checkpoint -> Hugging
    Face, into a new (or empty) directory; returns what it wrote there.

    A LoRA run's checkpoint (its meta has `lora`; it holds the adapters alone)
    becomes a PEFT adapter directory for the base the run adapted, or with
    `merge` a whole Hugging Face checkpoint: that base, read again from the
    run's model.hf_path, with the adapters merged into its weights. A QLoRA
    run's adapters are merged into the base as stored there, not into its
    NF4 form: the merged model differs from the one the run trained by the
    base's quantization error, as PEFT's merge over a dequantized base would
    by that error's rounding. What PEFT will not load of a run's adapters is
    said through `say` (`jlong.lora.peft_format.peft_caveat`)."""
    import jax
    from flax import nnx

    from jlong.hf import from_hf, to_hf

    source, destination = Path(source), Path(destination)
    if not source.is_dir():
        raise JlongError(f"{str(source)!r} is not a directory")
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise JlongError(f"{str(destination)!r} already exists and is not an empty directory; convert writes into "
                         "a new one (it never overwrites)")
    if (source / "config.json").is_file():
        if merge:
            raise JlongError(f"--merge merges a LoRA run's adapters into its base; {str(source)!r} is a Hugging "
                             "Face checkpoint: convert it without --merge")
        model = from_hf(source, param_dtype=param_dtype)
        checkpoints = Checkpoints(destination)
        checkpoints.save(0, nnx.to_pure_dict(nnx.state(model)), model=model.config)
        checkpoints.close()
        return sorted(destination.iterdir())
    if not saved_steps(source):
        raise JlongError(
            f"{str(source)!r} is neither a Hugging Face checkpoint (config.json) "
            "nor a jlong checkpoint directory"
        )
    checkpoints = Checkpoints(source)
    step = checkpoints.latest_step()
    meta = checkpoints.meta(step)
    saved_model = model_config(meta["model"])
    if meta.get("lora"):
        try:
            return _convert_lora(checkpoints, step, meta, saved_model, destination, param_dtype, merge, say)
        finally:
            checkpoints.close()
    if merge:
        checkpoints.close()
        raise JlongError(f"--merge merges a LoRA run's adapters into its base; {str(source)!r} holds the whole "
                         "model of a run without a lora section: convert it without --merge")
    from jlong.model.transformer import Transformer

    model = nnx.eval_shape(lambda: Transformer(saved_model, rngs=nnx.Rngs(0), param_dtype=param_dtype))
    graphdef, state = nnx.split(model)
    # Whole on this process's first device, whatever mesh wrote the checkpoint.
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), nnx.to_pure_dict(state))
    params, _ = checkpoints.restore(step, shapes, say=say)
    nnx.replace_by_pure_dict(state, params)
    to_hf(nnx.merge(graphdef, state), destination)
    checkpoints.close()
    return sorted(destination.iterdir())


def lora_of(meta: dict, model: ModelConfig):
    """The LoRA settings (`jlong.lora.targets.LoraSettings`) a LoRA run's checkpoint meta records."""
    from jlong.config.schema import LoraConfig
    from jlong.lora.targets import lora_settings

    section = LoraConfig.model_validate({k: v for k, v in meta["lora"].items() if k not in LORA_BASE_KEYS})
    return lora_settings(section, model)


def lora_base_digest(hf_path: str | None) -> str | None:
    """The digest of a LoRA run's base (`jlong.digests.hf_digest`; None for a base made from the seed)."""
    from jlong.digests import hf_digest

    return hf_digest(hf_path) if hf_path else None


def check_lora_base(meta: dict, hf_path: str | None, where: str, remedy: str,
                    say: Callable[[str], None]) -> str | None:
    """The digest of the LoRA base at `hf_path` now, refused in one line (naming `where`, then `remedy`)
    when the run that wrote the checkpoint (`meta`) adapted a base of other files there; a checkpoint
    that recorded none is said through `say`."""
    recorded, now = (meta.get("lora") or {}).get(BASE_DIGEST), lora_base_digest(hf_path)
    if recorded is None and now is not None:
        say(f"{where} has no record of its base's files (written before jlong kept one): the base in "
            f"{str(hf_path)!r} is taken as it is now, unchecked")
    elif recorded != now:
        raise JlongError(f"the base model in {str(hf_path)!r} is not the one {where} adapted: its files changed "
                         f"since (digest {recorded[:12]} then, {(now or 'none')[:12]} now); {remedy}")
    return now


def _convert_lora(checkpoints: Checkpoints, step: int, meta: dict, model: ModelConfig, destination: Path,
                  param_dtype: str, merge: bool, say: Callable[[str], None]) -> list[Path]:
    """A LoRA run's checkpoint as a PEFT adapter directory, or merged into its base (`convert`)."""
    import jax
    from flax import nnx

    from jlong.hf import load_hf_params, to_hf
    from jlong.lora import peft_format
    from jlong.model.transformer import Transformer

    lora = lora_of(meta, model)
    hf_path = meta["lora"].get("hf_path")
    where = f"checkpoint step {step} in {str(checkpoints.directory)!r}"
    if merge and not hf_path:
        raise JlongError(f"--merge: the run of {where} had no model.hf_path, so there is no base to merge its "
                         "adapters into; convert it without --merge for its PEFT adapters")
    if merge and not (Path(hf_path) / "config.json").is_file():
        raise JlongError(f"--merge: the base of {where}, model.hf_path {str(hf_path)!r}, is not a Hugging Face "
                         "checkpoint (no config.json there); restore it, or convert without --merge")
    if merge:
        check_lora_base(meta, hf_path, where, "restore that base to merge into it, or convert without --merge for "
                        "the PEFT adapters", say)
    adapters = _restored_adapters(checkpoints, step, model, lora, say)
    if not merge:
        written = peft_format.write_adapters(destination, adapters, model, lora, hf_path, param_dtype)
        if note := peft_format.peft_caveat(model, lora):
            say(note)
        return written
    base = nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0), param_dtype="float32"))
    graphdef, state = nnx.split(base)
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), nnx.to_pure_dict(state))
    params = jax.tree.map(np.asarray, load_hf_params(hf_path, model, shapes))
    params["layers"] = peft_format.merged(params["layers"], adapters, lora)
    params = jax.tree.map(lambda w: jax.numpy.asarray(w, param_dtype), params)
    nnx.replace_by_pure_dict(state, params)
    to_hf(nnx.merge(graphdef, state), destination)
    return sorted(destination.iterdir())


def _restored_adapters(checkpoints: Checkpoints, step: int, model: ModelConfig, lora,
                       say: Callable[[str], None]) -> dict[str, np.ndarray]:
    """A LoRA run's adapters, {name: float32 array}, checked against what its meta says they adapt."""
    import jax

    from jlong.lora.peft_format import adapter_shapes

    metadata = ocp.StandardCheckpointHandler().metadata(epath.Path(checkpoints.directory / str(step) / "params"))
    saved = _layout(metadata)
    expected = {f"layers/{name}": shape for name, shape in adapter_shapes(model, lora).items()}
    if {path: shape for path, (shape, _) in saved.items()} != expected:
        first = min(saved.keys() ^ expected.keys() or {k for k in saved if saved[k][0] != expected[k]})
        described = f"[{', '.join(map(str, expected[first]))}]" if first in expected else "nothing"
        raise JlongError(f"checkpoint step {step} in {str(checkpoints.directory)!r} holds params of another layout "
                         f"than the adapters its meta describes ({first}: {_shape(saved.get(first))} saved, "
                         f"{described} described)")
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = {"layers": {path.removeprefix("layers/"): jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype),
                                                                              sharding=here)
                           for path, (shape, dtype) in saved.items()}}
    params, _ = checkpoints.restore(step, abstract, say=say)
    return {name: np.asarray(value, np.float32) for name, value in params["layers"].items()}
