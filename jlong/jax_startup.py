"""Starting jax for jlong's commands, before its backends exist.

Where the CUDA plugin is installed on a machine without an NVIDIA driver (a
laptop or CI that plans GPU runs), its libraries write "no driver" lines
straight to file descriptor 2 when jax is imported and when the backends
start. Those lines are silenced there; on a machine with a driver nothing is.
"""

from __future__ import annotations

import contextlib
import os
import sys

from jlong.jax_private import private


def import_jax_quietly() -> None:
    if "jax" not in sys.modules:
        with _quiet_without_driver():
            import jax  # noqa: F401


def start_backends(cpu_devices: int | None = None) -> None:
    """Starts jax's backends; `cpu_devices` virtual CPU devices first, unless
    XLA_FLAGS already names a count. Multi-process initialisation, when
    wanted, must come before this. Where jax has started already (a script
    or notebook ran something), it must have at least that many CPU devices."""
    import jax

    if backends_started():
        _check_cpu_devices(cpu_devices)
        return
    if cpu_devices and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    with _quiet_without_driver():
        jax.devices()


def backends_started() -> bool:
    return private("jax._src.xla_bridge", "backends_are_initialized")()


def _check_cpu_devices(wanted: int | None) -> None:
    import jax

    from jlong.errors import JlongError

    have = len(jax.devices("cpu"))
    if wanted and have < wanted and jax.default_backend() == "cpu":
        raise JlongError(
            f"jax started with {have} CPU device(s) before jlong could give it the {wanted} this mesh needs: "
            f"call jax.config.update('jax_num_cpu_devices', {wanted}) right after 'import jax', before anything "
            f"runs (or set XLA_FLAGS=--xla_force_host_platform_device_count={wanted}), or restart the process"
        )


def _has_nvidia_driver() -> bool:
    return os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl")


def _quiet_without_driver():
    return contextlib.nullcontext() if _has_nvidia_driver() else quiet_native_stderr()


@contextlib.contextmanager
def quiet_native_stderr():
    """Silences what native libraries write to file descriptor 2; Python
    exceptions still arrive."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()  # what Python wrote meanwhile goes where fd 2 went, not after it
        os.dup2(saved, 2)
        os.close(saved)
