"""Test platform: the CPU with 8 virtual devices, float32 matmuls at full
precision, and one persistent compilation cache for the session, shared by
pytest-xdist's workers: the same program compiled again (by another test,
another worker, or a `jlong` subprocess, which inherits the environment) is
read back instead of recompiled."""

import os
import tempfile

# LLVM's optimisation is switched off: the tests' CPU programs are small and many, and most of their time
# went to compiling them (the suite runs in about 70% of the time); numbers are compared between programs
# compiled alike. The flag reaches XLA:GPU's PTX generation too: the deviceless GPU tests read HLO, memory
# and custom calls, never registers, spills or times of the code LLVM makes.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One cache for the whole run: pytest-xdist's workers share a run id, so a program one worker compiled is
# read back by the other (and by the `jlong` subprocesses both start).
_run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
_cache = os.path.join(tempfile.gettempdir(), f"jlong-tests-xla-cache-{_run}") if _run else tempfile.mkdtemp(
    prefix="jlong-tests-xla-cache-")
os.makedirs(_cache, exist_ok=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import jlong.components  # noqa: E402, F401  (the families and methods a config names, as jlong's entry points load them)
