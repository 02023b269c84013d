"""Host offload in a program compiled for abstract GPUs, where JAX cannot say it.

    lowered = lower_train_step(step, state, batch)          # make_train_step(model, optimizer, offload=...)
    lowered.compile().memory_analysis()                     # device and host bytes apart, as on the GPU

    placed = place_on_host(lowered, host_arguments=[3, 4], host_results=[3, 4])   # any lowered program

Abstract target devices (`distributed.targets`) have no memory spaces, so JAX drops `pinned_host` from the
shardings placed on them, and a step built with `offload=` lowers there as if nothing were offloaded. The
program a GPU runs differs from the plain one only in placement: an offloaded argument is declared in pinned host
memory and moved to the device where the step starts (`annotate_device_placement` to "device": what the step's
`jax.device_put(x, sharding.with_memory_kind("device"))` lowers to on a GPU), and an offloaded result is moved to
the host before it is returned (the out-sharding's `pinned_host`). `place_on_host` writes exactly those into a
copy of the lowered module (JAX caches the original), so XLA:GPU schedules the transfers and counts host bytes
apart from device bytes as it would on the GPU. tests/target_compile/test_gpu_target.py holds them equal to what
JAX writes for the offloaded step when it lowers it for a GPU from CPU devices, which have pinned host memory.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import jax

HOST_MEMORY = "pinned_host"
PLACEMENT_CALL = "annotate_device_placement"


def lower_train_step(step, state, batch: dict):
    """`step` (a `make_train_step` step) lowered for `state` and `batch` (sharded `ShapeDtypeStruct`s): on abstract
    target GPUs with its offloaded state's placement written in (`place_on_host`), elsewhere as it is."""
    lowered = step.lower(state, batch)
    if step.memory_kind is None or not step.model.compiles_only:
        return lowered
    offloaded = offloaded_leaves(state, step.memory_kind)
    frozen = () if step.trainable.everything else (step.frozen(),)   # the step's third argument, when it has one
    return place_on_host(lowered, host_arguments=offloaded, host_results=offloaded,
                         argument_count=len(jax.tree.leaves((state, batch, *frozen))))


def offloaded_leaves(state, memory_kinds: tuple[str | None, str | None]) -> list[int]:
    """The flat indices of the leaves of `state` kept in host memory between steps under `memory_kinds` (the
    parameters', the optimizer state's: `TrainStep.memory_kind`), as `train_state_shardings` places them
    (parameters; optimizer-state leaves laid out like a parameter, not its replicated counts): they lead the
    step's arguments (state, batch) and its results (state, metrics) alike."""
    from ..training.state import parameter_sharding_of

    parameters, optimizer_state = memory_kinds
    shapes = {name: leaf.shape for name, leaf in state.params.items()}
    names = dict.fromkeys(shapes, True)

    def offloaded(path, leaf) -> bool:
        if path[0].name == "params":
            return parameters is not None
        return (path[0].name == "opt_state" and optimizer_state is not None
                and parameter_sharding_of(path[1:], leaf, names, shapes, False))

    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    return [index for index, (path, leaf) in enumerate(leaves) if offloaded(path, leaf)]


def place_on_host(lowered, *, host_arguments: Iterable[int], host_results: Iterable[int],
                  argument_count: int | None = None):
    """A copy of `lowered` (a `jax.stages.Lowered`, left as it is: JAX caches it) whose flat arguments
    `host_arguments` and results `host_results` are declared in pinned host memory, each argument moved to the
    device where the program starts (as the train step moves it) and each result moved to the host before it
    returns; compile it as any lowered program. argument_count: the flat arguments the caller counted; a program
    that dropped unused ones (so indices would shift) is refused."""
    from jaxlib.mlir import ir

    original = lowered.compiler_ir("stablehlo")
    host_arguments, host_results = sorted(set(host_arguments)), sorted(set(host_results))
    with original.context, ir.Location.unknown():
        module = ir.Module.parse(original.operation.get_asm(enable_debug_info=True))
        main = _entry(module)
        block = main.regions[0].blocks[0]
        argument_attributes = list(main.attributes["arg_attrs"])
        result_attributes = list(main.attributes["res_attrs"])
        if argument_count is not None and argument_count != len(argument_attributes):
            raise ValueError(f"the lowered program takes {len(argument_attributes)} arguments, not the "
                             f"{argument_count} counted: it dropped unused ones, so their indices do not match.")
        _check_indices("argument", host_arguments, len(argument_attributes))
        _check_indices("result", host_results, len(result_attributes))
        start = block.operations[0]
        for index in host_arguments:
            argument = block.arguments[index]
            moved = _placement(argument, "device", ir.InsertionPoint(start))
            argument.replace_all_uses_except(moved.result, moved.operation)
            argument_attributes[index] = _in_memory(argument_attributes[index], HOST_MEMORY)
        ret = block.operations[len(block.operations) - 1]
        for index in host_results:
            moved = _placement(ret.operands[index], HOST_MEMORY, ir.InsertionPoint(ret))
            ret.operands[index] = moved.result
            result_attributes[index] = _in_memory(result_attributes[index], HOST_MEMORY)
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(argument_attributes)
        main.attributes["res_attrs"] = ir.ArrayAttr.get(result_attributes)
    return _with_module(lowered, module)


def _with_module(lowered, module):
    """`lowered` compiling `module` instead: a copy of its lowering (JAX's `MeshComputation`), without the
    executable a compile of the original may have left on it."""
    lowering = getattr(lowered, "_lowering", None)
    if lowering is None or not hasattr(lowering, "_hlo") or not hasattr(lowering, "_executable"):
        raise RuntimeError(f"this JAX version ({_jax_version()}) lowers programs in a form host placement does not "
                           "know, so the offloaded program cannot be written for abstract GPUs; compile the "
                           "offloaded step on a GPU instead.")
    lowering = copy.copy(lowering)
    lowering._hlo, lowering._executable = module, None
    placed = copy.copy(lowered)
    placed._lowering = lowering
    return placed


def _jax_version() -> str:
    import jax

    return jax.__version__


def _entry(module):
    from jaxlib.mlir import ir

    for operation in module.body.operations:
        if "sym_name" in operation.attributes and ir.StringAttr(operation.attributes["sym_name"]).value == "main":
            return operation
    raise ValueError("the lowered module has no `main` function to place arguments of.")


def _check_indices(what: str, indices: list[int], count: int) -> None:
    if indices and not 0 <= indices[0] <= indices[-1] < count:
        raise ValueError(f"host {what}s {indices}: the program has {count} {what}s (0 to {count - 1}).")


def _placement(value, memory: str, where):
    """`annotate_device_placement(value)` to `memory`, inserted at `where`: XLA's transfer between memories."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import stablehlo

    call = stablehlo.CustomCallOp([value.type], [value], PLACEMENT_CALL, has_side_effect=True,
                                  backend_config=ir.StringAttr.get(""),
                                  api_version=ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1), ip=where)
    call.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get({"_xla_buffer_placement": ir.StringAttr.get(memory)})
    return call


def _in_memory(attributes, memory: str):
    from jaxlib.mlir import ir

    entries = {entry.name: entry.attr for entry in ir.DictAttr(attributes)}
    entries["mhlo.memory_kind"] = ir.StringAttr.get(memory)
    return ir.DictAttr.get(entries)
