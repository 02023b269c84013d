"""Layouts compiled side by side in worker processes: XLA's compile of one program keeps a single core busy (and
holds the interpreter while it does), so a plan of many layouts on N cores compiles N at a time in N processes.

    with CompilePool(workers=2, devices=DeviceSpec("cpu", 8)) as pool:
        future = pool.submit(config_values, layout, request, for_cpu=True)     # -> CompiledStep
        step = future.result()

One worker compiles in this process (no start-up cost: what the library's `plan_layouts` does by default). More
start processes (spawned: a fresh JAX each, with the virtual CPU devices or abstract target GPUs the plan
compiles on) that build, lower and compile a layout from its picklable description and send back the
`CompiledStep`. Each takes about one core and the host memory of its program.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass

from .compiled_step import CompiledStep, compile_layout_step
from .layouts import Layout
from .request import PlanRequest

MAX_COMPILE_WORKERS = 4    # each worker holds its own program's host memory


def default_compile_workers() -> int:
    """One compile per core, at most `MAX_COMPILE_WORKERS`."""
    return max(1, min(os.cpu_count() or 1, MAX_COMPILE_WORKERS))


@dataclass(frozen=True)
class DeviceSpec:
    """The devices a plan compiles on, as a worker process can make them again: `count` of JAX's CPU devices
    ("cpu"), or abstract GPUs of a target (`moe_jax.distributed.target_devices`)."""

    hardware: str
    count: int

    def devices(self) -> list:
        if self.hardware == "cpu":
            import jax

            return jax.devices("cpu")[:self.count]
        from ..distributed.targets import target_devices, whole_hosts

        return target_devices(self.hardware, whole_hosts(self.count))


def quiet_compiler_logs() -> None:
    """XLA's C++ warnings about the compiled programs (a partitioner's resharding, a deviceless sort) would bury
    the answer, whose rows carry what they describe: errors only, unless `MOE_JAX_VERBOSE` is set."""
    from ..verbosity import verbose

    if not verbose():
        import jax

        jax.config.update("jax_logging_level", "ERROR")


def _start_worker(cpu_devices: int) -> None:
    """A worker's JAX, before it starts: the virtual CPU devices, quiet C++ logs (the plan reads its own costs)."""
    from ..host_devices import use_cpu_devices

    use_cpu_devices(cpu_devices, override=True)
    quiet_compiler_logs()


def _compile(config_values: dict, layout: Layout, request: PlanRequest, devices: DeviceSpec,
             for_cpu: bool) -> CompiledStep:
    return compile_layout_step(config_values, layout, request, devices.devices(), for_cpu=for_cpu)


class CompilePool:
    """`submit` a layout, get a `Future` of its `CompiledStep`; `workers` > 1 compiles in that many processes."""

    def __init__(self, workers: int, devices: DeviceSpec, local_devices: list | None = None):
        if workers < 1:
            raise ValueError(f"--compile-workers {workers}: compile at least one layout at a time.")
        self.workers, self.spec, self.local_devices = workers, devices, local_devices
        self._executor = None

    def __enter__(self) -> CompilePool:
        if self.workers > 1:
            self._executor = ProcessPoolExecutor(max_workers=self.workers,
                                                 mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_start_worker, initargs=(max(self.spec.count, 1),))
        return self

    def __exit__(self, *exc) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def submit(self, config_values: dict, layout: Layout, request: PlanRequest, *, for_cpu: bool) -> Future:
        if self._executor is not None:
            return self._executor.submit(_compile, config_values, layout, request, self.spec, for_cpu)
        future: Future = Future()     # one worker: compiled here and now, on the plan's own devices
        try:
            devices = self.local_devices if self.local_devices is not None else self.spec.devices()
            future.set_result(compile_layout_step(config_values, layout, request, devices, for_cpu=for_cpu))
        except Exception as error:    # noqa: BLE001 - handed to the caller through the future, as a process's
            future.set_exception(error)
        return future
