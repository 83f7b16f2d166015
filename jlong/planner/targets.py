"""What the planner compiles for: a GPU model (XLA:GPU, deviceless) or the CPU.

XLA:GPU compiles without a GPU. Given a description of the device (a
`stream_executor.GpuTargetConfigProto`, written here from published device
facts) and a topology `1 x nodes x gpus_per_node`, the CUDA plugin hands out
compile-only devices: a mesh over them compiles the train step exactly as a
real node would, and `memory_analysis()` gives per-device and host bytes.
Nothing is autotuned and nothing runs.

The `cpu` target compiles for virtual CPU devices instead (any machine, no
plugin), with the corrections `jlong.planner.memory` describes.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util

from jlong.errors import JlongError
from jlong.jax_private import private
from jlong.planner.gpu_memory import POOL_RESERVE_GIB
from jlong.jax_startup import backends_started, quiet_native_stderr, start_backends

GIB = 1024**3
# Installed from a clone, as the README installs jlong; about 2.7 GB on disk (2,747,670,792 bytes measured in a
# Linux venv: cuDNN 1.1 GB, cuBLAS 0.8 GB, XLA's CUDA plugin 0.5 GB, NVRTC 0.2 GB).
GPU_PLAN_INSTALL = ('pip install -e ".[gpu-plan]" in your jlong clone (about 2.7 GB: the CUDA plugin matching '
                    'jaxlib, and cuDNN)')

CUDA_PLUGIN_MODULES = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
MIN_CUDNN_FOR_DEVICELESS_ATTENTION = (9, 8, 0)  # XLA refuses to compile cuDNN attention below this

# Host memory per node the default plan may fill with offloaded activations:
# an 8xH100 node has 2 TiB; the rest is for the OS, the data pipeline and
# pinned staging buffers.
DEFAULT_HOST_BUDGET_GIB = 1536.0


@dataclasses.dataclass(frozen=True)
class GpuModel:
    """Published facts of one GPU, as the CUDA runtime reports them."""

    name: str  # the device name the CUDA runtime reports
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int  # total device memory (cudaDeviceProp.totalGlobalMem)
    memory_bus_bits: int
    memory_clock_mhz: int
    l2_cache_bytes: int
    clock_ghz: float  # boost clock of the SMs
    # Data-sheet rates for the step-cost estimate (bytes per second are per direction, per GPU).
    peak_bf16_flops: float  # dense bf16 tensor-core FLOP/s
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # to the other GPUs of the node
    infiniband_bytes_per_s: float  # to other nodes: one NIC per GPU
    pcie_bytes_per_s: float  # to host memory: PCIe Gen5 x16 is 64 GB/s a direction (H100, H200)
    shared_memory_per_sm: int = 228 * 1024
    shared_memory_per_block_optin: int = 227 * 1024
    shared_memory_per_block: int = 48 * 1024
    fp32_lanes_per_sm: int = 128
    threads_per_sm: int = 2048
    threads_per_block: int = 1024
    registers_per_sm: int = 64 * 1024
    registers_per_block: int = 64 * 1024

    @property
    def memory_bandwidth(self) -> int:
        """Bytes per second: bus width x memory clock, double data rate."""
        return self.memory_bus_bits // 8 * self.memory_clock_mhz * 10**6 * 2


GPUS = {
    "h100": GpuModel(
        name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), sm_count=132, memory_bytes=84_942_979_072,
        memory_bus_bits=5120, memory_clock_mhz=2619, l2_cache_bytes=50 * 2**20, clock_ghz=1.98,
        peak_bf16_flops=989e12, hbm_bytes_per_s=3.35e12, nvlink_bytes_per_s=450e9, infiniband_bytes_per_s=50e9,
        pcie_bytes_per_s=64e9,
    ),
    "h200": GpuModel(
        name="NVIDIA H200 141GB HBM3e", compute_capability=(9, 0), sm_count=132, memory_bytes=151_397_597_184,
        memory_bus_bits=5120, memory_clock_mhz=3750, l2_cache_bytes=50 * 2**20, clock_ghz=1.98,
        peak_bf16_flops=989e12, hbm_bytes_per_s=4.8e12, nvlink_bytes_per_s=450e9, infiniband_bytes_per_s=50e9,
        pcie_bytes_per_s=64e9,
    ),
    "b200": GpuModel(
        name="NVIDIA B200", compute_capability=(10, 0), sm_count=148, memory_bytes=182_630 * 2**20,
        memory_bus_bits=7680, memory_clock_mhz=3996, l2_cache_bytes=126 * 2**20 + 2**19, clock_ghz=1.965,
        peak_bf16_flops=2250e12, hbm_bytes_per_s=8e12, nvlink_bytes_per_s=900e9, infiniband_bytes_per_s=50e9,
        pcie_bytes_per_s=50e9,
    ),
}
TARGETS = (*GPUS, "cpu")

# Dense bf16 tensor-core peaks (FLOP/s) by device_kind substring, for the MFU
# of a running step: the GPU table's, and the A100, which jlong does not plan for but may run on.
PEAK_BF16_FLOPS = {"A100": 312e12, **{name.upper(): gpu.peak_bf16_flops for name, gpu in GPUS.items()}}


def peak_flops_per_device() -> float | None:
    """The bf16 peak of this process's first device (None off GPUs, or for an unknown GPU)."""
    import jax

    device = jax.devices()[0]
    if device.platform != "gpu":
        return None
    for name, flops in PEAK_BF16_FLOPS.items():
        if name in device.device_kind:
            return flops
    return None


def target_config_text(gpu: GpuModel, cudnn: tuple[int, int, int]) -> str:
    """The GpuTargetConfigProto (text format) that XLA:GPU compiles against.

    Only the device facts that shape code generation and buffer assignment
    are written; the per-instruction rate tables feed XLA's cost model only.
    """
    major, minor = gpu.compute_capability
    fields = {
        "threads_per_block_limit": gpu.threads_per_block,
        "threads_per_warp": 32,
        "shared_memory_per_block": gpu.shared_memory_per_block,
        "shared_memory_per_core": gpu.shared_memory_per_sm,
        "threads_per_core_limit": gpu.threads_per_sm,
        "core_count": gpu.sm_count,
        "fpus_per_core": gpu.fp32_lanes_per_sm,
        "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535,
        "block_dim_limit_z": 65535,
        "memory_bandwidth": gpu.memory_bandwidth,
        "l2_cache_size": gpu.l2_cache_bytes,
        "clock_rate_ghz": gpu.clock_ghz,
        "device_memory_size": gpu.memory_bytes,
        "shared_memory_per_block_optin": gpu.shared_memory_per_block_optin,
        "registers_per_core_limit": gpu.registers_per_sm,
        "registers_per_block_limit": gpu.registers_per_block,
    }
    lines = ["gpu_device_info {"]
    lines += [f"  {key}: {value}" for key, value in fields.items()]
    # The "a" variant (sm_90a, sm_100a): the architecture-specific instructions
    # (Hopper's wgmma, Blackwell's tcgen05) that XLA's kernels use on these GPUs.
    lines += [f"  cuda_compute_capability {{ major: {major} minor: {minor} feature_extension: ACCELERATED_FEATURES }}",
              "}"]
    lines += [
        'platform_name: "CUDA"',
        f"dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} patch: {cudnn[2]} }}",
        f'device_description_str: "{gpu.name}"',
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------
# Choosing a target


def cuda_plugin_installed() -> bool:
    return any(_module_exists(name) for name in CUDA_PLUGIN_MODULES)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def resolve_target(name: str | None) -> str:
    """The target to plan for: the one named, else h100 where the CUDA plugin
    is installed and cpu elsewhere."""
    if name is None:
        return "h100" if cuda_plugin_installed() else "cpu"
    name = name.lower()
    if name not in TARGETS:
        close = difflib.get_close_matches(name, TARGETS, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise JlongError(f"unknown target {name!r}{hint}; choose one of {', '.join(TARGETS)}", "target")
    if name in GPUS and not cuda_plugin_installed():
        raise JlongError(f"target {name} compiles with XLA:GPU, which needs the CUDA plugin: {GPU_PLAN_INSTALL}; "
                         "or plan with target cpu", "target")
    return name


def default_budget_gib(target: str, gpu_memory_fraction: float) -> float:
    """Per-device budget: the share of the GPU's memory a run asks XLA for,
    less the pool reserve. The cpu target plans for an H100."""
    gpu = GPUS.get(target, GPUS["h100"])
    return gpu_memory_fraction * gpu.memory_bytes / GIB - POOL_RESERVE_GIB


def known_gpu(device) -> str | None:
    """The planner's name for a device's GPU model ("h100"), or None (a CPU, another GPU)."""
    if device.platform != "gpu":
        return None
    return next((name for name in GPUS if name.upper() in device.device_kind.upper()), None)


def node_shape(device_count: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, devices per node) of a mesh: whole nodes, or part of one."""
    if gpus_per_node <= 0:
        raise JlongError(f"gpus_per_node must be positive, got {gpus_per_node}", "gpus_per_node")
    if device_count <= gpus_per_node:
        return 1, device_count
    if device_count % gpus_per_node:
        raise JlongError(
            f"the mesh's {device_count} devices do not fill whole nodes of gpus_per_node {gpus_per_node}; "
            f"make the mesh a multiple of {gpus_per_node}", "gpus_per_node"
        )
    return device_count // gpus_per_node, gpus_per_node


# --------------------------------------------------------------------------
# Devices to compile for


def start_planning_backend(cpu_devices: int) -> None:
    """Starts jax for planning, which never touches a real accelerator: on the
    CPU, with `cpu_devices` virtual devices, and the CUDA plugin loaded only
    for its compiler (it skips its driver checks there)."""
    import jax

    if not backends_started() and jax.config.jax_platforms != "cpu":
        jax.config.update("jax_platforms", "cpu")
    start_backends(cpu_devices)


def installed_cudnn_version() -> tuple[int, int, int] | None:
    """The cuDNN the CUDA plugin loads (None without one)."""
    cuda_versions = private("jax._src.lib", "cuda_versions")  # None without the CUDA plugin
    try:
        number = cuda_versions.cudnn_get_version()
    except Exception:  # no plugin, or no cuDNN library to load
        return None
    if not number:
        return None
    return number // 10000, number // 100 % 100, number % 100


def gpu_devices(target: str, device_count: int, gpus_per_node: int = 8) -> list:
    """Compile-only devices of `target` GPUs: topology 1 x nodes x per node."""
    nodes, per_node = node_shape(device_count, gpus_per_node)
    return list(_topology(target, nodes, per_node))


@functools.lru_cache(maxsize=None)
def _topology(target: str, nodes: int, per_node: int) -> tuple:
    from jax.experimental import topologies

    with quiet_native_stderr():
        cudnn = installed_cudnn_version()
        if cudnn is None:
            raise JlongError(f"target {target} needs cuDNN for the CUDA plugin to load: {GPU_PLAN_INSTALL}", "target")
        if cudnn < MIN_CUDNN_FOR_DEVICELESS_ATTENTION:
            raise JlongError(f"cuDNN {'.'.join(map(str, cudnn))} is installed; XLA compiles for GPUs without one "
                             f"only from cuDNN 9.8: {GPU_PLAN_INSTALL}")
        try:
            topology = topologies.get_topology_desc(
                platform="cuda", topology=f"1x{nodes}x{per_node}",
                target_config=target_config_text(GPUS[target], cudnn),
            )
        except Exception as err:  # a plugin that does not match jaxlib, or none registered
            raise JlongError(f"the CUDA plugin cannot compile for target {target} "
                             f"({str(err).splitlines()[0][:160]}): {GPU_PLAN_INSTALL}", "target") from None
    return tuple(topology.devices)


# --------------------------------------------------------------------------
# A target with its budgets


@dataclasses.dataclass(frozen=True)
class PlanTarget:
    """What a plan compiles for and the budgets it is held to."""

    name: str = "cpu"  # one of TARGETS
    budget_gib: float | None = None  # per device; None: `default_budget_gib` for the config
    host_budget_gib: float = DEFAULT_HOST_BUDGET_GIB  # per node
    gpus_per_node: int = 8

    @property
    def is_gpu(self) -> bool:
        return self.name in GPUS

    def device_budget_gib(self, gpu_memory_fraction: float) -> float:
        if self.budget_gib is not None:
            return self.budget_gib
        return default_budget_gib(self.name, gpu_memory_fraction)

    def describe_budget(self, gpu_memory_fraction: float) -> str:
        """Where the device budget comes from, for reports."""
        if self.budget_gib is not None:
            return f"{self.budget_gib:.2f} GiB per device (as given)"
        gpu = GPUS.get(self.name, GPUS["h100"])
        return (f"{default_budget_gib(self.name, gpu_memory_fraction):.2f} GiB per device = "
                f"train.gpu_memory_fraction {gpu_memory_fraction:g} x {gpu.memory_bytes / GIB:.1f} GiB "
                f"({gpu.name}) - {POOL_RESERVE_GIB:g} GiB reserve")

    def devices(self, count: int) -> list:
        """`count` devices to compile for: compile-only GPUs, or virtual CPU
        devices (`start_planning_backend` gives the CPU enough of them)."""
        if self.is_gpu:
            return gpu_devices(self.name, count, self.gpus_per_node)
        import jax

        return jax.devices("cpu")[:count]

    def compiler(self) -> str:
        if self.is_gpu:
            cudnn = installed_cudnn_version()
            version = ".".join(map(str, cudnn)) if cudnn else "none"
            return f"XLA:GPU for {GPUS[self.name].name}, deviceless (cuDNN {version})"
        return "XLA:CPU on virtual devices, corrected toward the GPU program"
