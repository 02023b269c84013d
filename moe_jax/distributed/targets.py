"""Abstract GPUs to compile for on any machine: XLA:GPU's compiler without a GPU.

    devices = target_devices("h100", 8)        # 8 abstract H100s on one host; 16 = two hosts of 8
    model = AutoModelForCausalLM.from_config(config, DistributedConfig(fsdp_size=8, ep_size=8), devices=devices)
    compiled = make_train_step(model, optimizer).lower(state, batch).compile()   # XLA:GPU's program

The devices come from JAX's CUDA plugin (`pip install "jax[cuda13]==<jax's version>"`): it holds XLA:GPU, and
given a target description (`gpu_targets`) and a topology it makes compile-only devices. Meshes, shardings,
`lower()` and `compile()` accept them; `memory_analysis()` and the optimized HLO are XLA:GPU's. Nothing can be
placed on them or run: a program compiled for them is serialised (`jax.experimental.serialize_executable`) and
loaded on the real machine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

from .gpu_targets import gpu_target

DEVICES_PER_HOST = 8


class CompilerUnavailable(RuntimeError):
    """The GPU compiler cannot be had here: JAX's CUDA plugin is missing or did not register."""


CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
# The CUDA plugin checks the CUDA libraries against a GPU driver when it registers; without a GPU that check
# fails and the plugin is not registered. Skipping it is what compiling without a GPU needs.
SKIP_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"


def cuda_plugin_install_line() -> str:
    import jax

    return f'pip install "jax[cuda13]=={jax.__version__}"'


def cuda_plugin_available() -> bool:
    """Whether a JAX CUDA plugin is installed (it holds XLA:GPU's compiler)."""
    return any(_spec(name) is not None for name in CUDA_PLUGINS)


def _spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:       # jax_plugins itself absent
        return None


@contextlib.contextmanager
def _without_cuda_version_check():
    """The plugin registers on JAX's first plugin discovery: skip its driver check there, and only there."""
    had = SKIP_CHECK in os.environ
    os.environ.setdefault(SKIP_CHECK, "1")
    try:
        yield
    finally:
        if not had:
            os.environ.pop(SKIP_CHECK, None)


def whole_hosts(count: int) -> int:
    """`count` rounded up to what `target_devices` can make: itself up to one host, then whole hosts of 8."""
    return count if count <= DEVICES_PER_HOST else -(-count // DEVICES_PER_HOST) * DEVICES_PER_HOST


def topology_name(count: int) -> str:
    """XLA's "slices x hosts x devices per host" for `count` devices: one host up to 8, then hosts of 8."""
    if count < 1:
        raise ValueError(f"target devices: count={count}; ask for at least one device.")
    if count <= DEVICES_PER_HOST:
        return f"1x1x{count}"
    if count % DEVICES_PER_HOST:
        raise ValueError(f"target devices: count={count} does not fill hosts of {DEVICES_PER_HOST} GPUs; use up to "
                         f"{DEVICES_PER_HOST} or a multiple of {DEVICES_PER_HOST}.")
    return f"1x{count // DEVICES_PER_HOST}x{DEVICES_PER_HOST}"


def target_devices(hardware: str, count: int) -> list:
    """`count` abstract devices of `hardware` (a name in `gpu_targets.GPU_TARGETS`: h100, h200, b200, a100) to
    compile for; nothing is ever allocated on them. Needs JAX's CUDA plugin (not a GPU)."""
    target = gpu_target(hardware)
    topology = topology_name(count)
    if not cuda_plugin_available():
        raise CompilerUnavailable(f"compiling for {hardware} needs JAX's CUDA plugin, which holds XLA:GPU's compiler (no GPU "
                           f"is needed): {cuda_plugin_install_line()}, or pip install -e \".[gpu-compile]\".")
    from jax.experimental import topologies

    with _without_cuda_version_check():
        try:
            description = topologies.get_topology_desc(platform="cuda", target_config=target.config_text(),
                                                       topology=topology)
        except NotImplementedError as error:
            raise CompilerUnavailable(
                f"JAX's CUDA plugin is installed but not registered ({error}): JAX discovered its plugins before "
                f"this call, and without a GPU the plugin's driver check failed. Set {SKIP_CHECK}=1 (or "
                "JAX_PLATFORMS=cpu) before anything uses JAX, or call target_devices first.") from error
    return list(description.devices)


def is_compile_only(device) -> bool:
    """Whether `device` is an abstract target device (`target_devices`): programs compile for it, none runs."""
    return type(device.client).__name__ == "CompileOnlyPyClient"
