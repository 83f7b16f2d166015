"""Test platform: the CPU with 8 virtual devices, float32 matmuls at full
precision, and one persistent compilation cache for the session: the same
program compiled again (by another test, or by a `jlong` subprocess, which
inherits the environment) is read back instead of recompiled."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jlong-tests-xla-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
