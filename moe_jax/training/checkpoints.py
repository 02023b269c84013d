"""Train-state checkpoints with orbax: async saves every N steps, the last K kept, exact resume on any layout.

    checkpoints = TrainCheckpoints(directory, model, train_step, save_every=100, keep=3)
    checkpoints.save(step, state, capacity_state)               # async: returns once arrays are copied out
    state, capacity_state = checkpoints.restore()               # latest step, onto this model's layout
    checkpoints.wait()                                          # the last save is on disk
    checkpoints.close()                                         # wait, then release orbax's threads

A checkpoint holds the state's arrays (params, optimizer state, step, rng, data position) and a JSON
record: the model's type and config, its parameter shapes, the structure of the optimizer state, the
layout it was saved from, the dispatch capacity in force with its calm streak, and the caller's `run` settings
(`moe-jax train`: its learning-rate schedule and data settings). Restoring reads every
array directly into the shardings of the *current* model and optimizer (orbax reshards), so a state saved
with tp2/fsdp4/ep4 resumes with fsdp8/ep8. Orbax writes each step into a temporary directory and renames
it when complete, so a killed write never damages the last complete checkpoint (an unfinished one is
ignored and cleaned up).

A save still being written when the script ends is finished before the interpreter shuts down (see
`_finish_at_exit`), so a script that never calls `wait()` or `close()` loses nothing; `TrainLoop(...,
checkpoints=)` waits for its last save before `run` returns. The directory is created by the first save,
so a job refused before its first step leaves nothing behind.
"""

from __future__ import annotations

import atexit
import json
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..distributed.capacity import CapacityState
from ..models.layer_stack import stack_rows, unstacked_rows
from .state import TrainState, abstract_train_state, parameter_sharding_of
from .trainable import resolve_trainable

FORMAT = "moe_jax.train_state/1"


def model_record(model, trainable=None) -> dict:
    """What identifies a model's train state: type, config (minus the layout), the stored arrays' shapes and which
    HF parameters each storage entry holds (`storage`: the layer layout, pipeline stages or scanned runs). A state
    of part of the model (`trainable`: a LoRA adapter, a selection) records those arrays, which they are, and the
    adapter's settings."""
    trainable = resolve_trainable(model) if trainable is None else trainable
    config = model.config.to_dict()
    config.pop("distributed_config", None)
    record = {
        "model_type": model.model_type,
        "config": json.loads(json.dumps(config, default=str)),
        "parameters": {name: list(shape) for name, shape in trainable.shapes(model).items()},
        "storage": {name: list(members) for name, members in trainable.members(model).items()},
        "dtype": jnp.dtype(model.dtype).name,
    }
    if model.adapter_layout is not None:
        record["adapter"] = model.adapter_config.to_peft_dict() | {"base_model_name_or_path": None}
    if not trainable.everything:
        record["trainable"] = list(trainable.names)
    if model.num_redundant_experts:   # the state holds an expert placement of that many slots
        record["num_redundant_experts"] = model.num_redundant_experts
    return record


def hf_shapes(record: dict) -> dict[str, list[int]] | None:
    """HF parameter name -> shape, from a record's storage shapes and members (None for records without them)."""
    if "storage" not in record:
        return None
    shapes = {}
    for storage, members in record["storage"].items():
        shape = record["parameters"][storage]
        for name in members:
            if name is not None:
                shapes[name] = shape[1:] if stack_rows(storage) else shape
    return shapes


def _is_per_parameter(node) -> bool:
    """A dict of one array (or empty masked node) per parameter: adam's mu, nu, momentum, ..."""
    return isinstance(node, dict) and all(not isinstance(value, (dict, list, tuple)) or value == ()
                                          for value in node.values())


def optimizer_structure(opt_state) -> str:
    """The optimizer state without its arrays, e.g. "(ScaleByAdamState(count, mu, nu), EmptyState(),
    EmptyState())" for AdamW and "(EmptyState(), EmptyState())" for SGD: what a resume must match."""
    def leaf(node) -> bool:
        return not isinstance(node, (dict, list, tuple)) or _is_per_parameter(node)

    def describe(node) -> str:
        if hasattr(node, "_fields"):  # an optax state (a named tuple)
            fields = [name if leaf(value) else f"{name}={describe(value)}"
                      for name, value in zip(node._fields, node)]
            return f"{type(node).__name__}({', '.join(fields)})"
        if isinstance(node, (list, tuple)):
            return f"({', '.join(describe(value) for value in node)})"
        if isinstance(node, dict) and not _is_per_parameter(node):
            return "{" + ", ".join(f"{key}: {describe(node[key])}" for key in sorted(node)) + "}"
        return "*"

    return describe(opt_state)


# Managers whose last save may still be in flight, by id (dropped by wait() and close()).
_UNFINISHED: dict[int, ocp.CheckpointManager] = {}
_exit_hook: list[bool] = []  # one element once _finish_at_exit is registered


def _finish_at_exit() -> None:
    """Waits for every save still being written, so a script that ends after `save` loses nothing.

    Registered as a *threading* exit hook: those run in reverse order of registration before the
    interpreter joins its threads, and concurrent.futures registers its own (which stops accepting work)
    when it is imported, before any of ours. An `atexit` hook would run after it, when orbax's background
    commit can no longer schedule work ("cannot schedule new futures after interpreter shutdown") and the
    step is left behind as a temporary directory.
    """
    while _UNFINISHED:
        _, manager = _UNFINISHED.popitem()
        try:
            manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001 (the interpreter is exiting: report, finish the others)
            print(f"moe_jax: a train-state checkpoint in {manager.directory} could not be finished at exit: "
                  f"{error}", file=sys.stderr)


def _register_exit_hook() -> None:
    if _exit_hook:
        return
    try:
        threading._register_atexit(_finish_at_exit)  # what concurrent.futures itself uses (Python >= 3.9)
    except (AttributeError, RuntimeError):  # not available, or the interpreter is already shutting down
        atexit.register(_finish_at_exit)
    _exit_hook.append(True)


class TrainCheckpoints:
    """Orbax `CheckpointManager` over `directory` for one model and train step."""

    def __init__(self, directory, model, train_step, *, save_every: int = 1, keep: int | None = 3,
                 async_save: bool = True, run: dict | None = None):
        if save_every < 1:
            raise ValueError(f"save_every={save_every} must be >= 1 (steps between checkpoints).")
        if keep is not None and keep < 1:
            raise ValueError(f"keep={keep} must be >= 1 (checkpoints kept), or None to keep all.")
        self.directory = Path(directory).absolute()
        self.model, self.train_step, self.save_every = model, train_step, save_every
        self.run = run   # the caller's settings kept in each save's record (`moe-jax train`: schedule, data)
        # create=False: orbax makes the directory with the first step it writes, not here.
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def should_save(self, step: int) -> bool:
        return step % self.save_every == 0

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: TrainState, capacity_state: CapacityState | None) -> None:
        record = {
            "format": FORMAT, "step": step, **model_record(self.model, self.train_step.trainable),
            "optimizer_state": optimizer_structure(state.opt_state),
            "layout": self.model.distributed_config.to_dict(),
            "capacity": None if capacity_state is None else {
                "capacity": capacity_state.capacity, "calm_calls": capacity_state.calm_calls,
                "calm_peak": capacity_state.calm_peak},
            **({} if self.run is None else {"run": self.run}),
        }
        record = json.loads(json.dumps(record, default=str))
        _register_exit_hook()
        _UNFINISHED[id(self.manager)] = self.manager  # finished at exit unless wait() or close() is called
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state.arrays()), record=ocp.args.JsonSave(record)))

    def record(self, step: int | None = None) -> dict:
        step = self._step(step)
        return self.manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"]

    def check_compatible(self, record: dict) -> None:
        """A clear error when the checkpoint belongs to another model (type, config or parameter shapes)."""
        ours = model_record(self.model, self.train_step.trainable)
        problems = []
        if record.get("adapter") != ours.get("adapter"):
            problems.append("its LoRA adapter's settings differ" if record.get("adapter") and ours.get("adapter")
                            else "one holds a LoRA adapter's state, the other a model's")
        if record.get("num_redundant_experts", 0) != ours.get("num_redundant_experts", 0):
            problems.append(f"it ran num_redundant_experts={record.get('num_redundant_experts', 0)} (this model "
                            f"{ours.get('num_redundant_experts', 0)}), whose expert placement the state holds")
        if record.get("trainable") != ours.get("trainable"):
            problems.append("it trained other arrays (another trainable selection or --freeze)")
        if record.get("format") != FORMAT:
            problems.append(f"format {record.get('format')!r} is not {FORMAT!r}")
        if record.get("model_type") != ours["model_type"]:
            problems.append(f"model_type {record.get('model_type')!r} != {ours['model_type']!r}")
        theirs, mine = record.get("parameters", {}), ours["parameters"]
        if hf_shapes(record) is not None and record["storage"] != ours["storage"]:
            theirs, mine = hf_shapes(record), hf_shapes(ours)  # another layer layout: compare per HF parameter
        if theirs != mine:
            differ = sorted(name for name in theirs.keys() | mine.keys() if theirs.get(name) != mine.get(name))
            problems.append(f"parameter shapes differ ({len(differ)}: {', '.join(differ[:4])}"
                            f"{', ...' if len(differ) > 4 else ''})")
        if record.get("dtype") != ours["dtype"]:
            problems.append(f"dtype {record.get('dtype')} != {ours['dtype']}")
        if problems:
            raise ValueError(
                f"{self.directory} holds a train state of another model: {'; '.join(problems)}. Use a new "
                "--checkpoint-dir for this model, or the model the checkpoint was saved from."
            )
        saved, current = record.get("optimizer_state"), self._optimizer_structure()
        if saved is not None and saved != current:  # (absent from checkpoints written before it was recorded)
            raise ValueError(
                f"{self.directory} holds a train state of another optimizer: its optimizer state is {saved}, "
                f"this optimizer's is {current}. Resume with the optimizer it was saved with (--optimizer, "
                "--expert-lr), or use a new --checkpoint-dir."
            )

    def restore(self, step: int | None = None) -> tuple[TrainState, CapacityState | None]:
        """The state saved at `step` (default the latest), read into this model's and step's shardings."""
        step = self._step(step)
        record = self.record(step)
        self.check_compatible(record)
        capacity_state = self._capacity_state(record.get("capacity"))
        capacity = None if capacity_state is None else capacity_state.capacity
        trainable = self.train_step.trainable
        target = abstract_train_state(self.model, self.train_step.optimizer, capacity,
                                      memory_kind=self.train_step.memory_kind, trainable=trainable)
        saved_members = record.get("storage")
        relayout = saved_members is not None and saved_members != model_record(self.model, trainable)["storage"]
        if relayout and not trainable.everything:
            raise ValueError(f"{self.directory} step {step} stores its layers another way (scanned runs or pipeline "
                             "stages); a state of part of the model resumes on the same layer layout: use the same "
                             "--scan-layers and --pp settings (tensor, expert and data parallel sizes may change).")
        if relayout:  # saved with other pipeline stages / scanned runs: read it as saved, then restack
            saved_target = self._saved_layout_target(target, record)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore((saved_target if relayout else target).arrays())))["state"]
        except ValueError as error:  # a state the record cannot vouch for; orbax's advice does not apply here
            raise ValueError(f"{self.directory} step {step} does not fit this model and optimizer: "
                             f"{str(error).splitlines()[0]}") from None
        if relayout:
            restored = self._restacked(restored, saved_members, target)
        return TrainState.from_arrays(restored, capacity), capacity_state

    def _saved_layout_target(self, target: TrainState, record: dict) -> TrainState:
        """The restore target in the saved storage layout, on this model's mesh: each entry sharded as its
        parameter is here, a stacked entry's row axis whole."""
        shardings, mesh = self.model.named_shardings(), self.model.mesh
        params = {}
        for storage, members in record["storage"].items():
            first = next(name for name in members if name is not None)
            spec = shardings[first].spec
            if stack_rows(storage):
                spec = P(None, *spec)
            params[storage] = jax.ShapeDtypeStruct(tuple(record["parameters"][storage]),
                                                   self.model.param_dtype(first), sharding=NamedSharding(mesh, spec))
        replicated = NamedSharding(mesh, P())
        opt_state = jax.eval_shape(self.train_step.optimizer.init, params)
        shapes = {name: leaf.shape for name, leaf in params.items()}
        param_shardings = {name: leaf.sharding for name, leaf in params.items()}
        opt_state = jax.tree_util.tree_map_with_path(
            lambda path, leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=parameter_sharding_of(
                path, leaf, param_shardings, shapes, replicated)), opt_state)
        return target.replace(params=params, opt_state=opt_state)

    def _restacked(self, restored: dict, saved_members: dict, target: TrainState) -> dict:
        """The restored arrays moved from the saved storage layout into this model's (one jitted program). Every
        per-parameter dict (params, adam's mu / nu, ...) is restacked; entries without state (`optax.MaskedNode`:
        frozen buffers) stay without it."""
        stack, names = self.model.layer_stack, set(saved_members)

        def per_parameter(node) -> bool:
            return isinstance(node, dict) and set(node) == names

        def convert(node):
            if not per_parameter(node):
                return node
            arrays = {name: value for name, value in node.items() if not isinstance(value, optax.MaskedNode)}
            per_layer = unstacked_rows(arrays, saved_members)
            return {storage: stack.stack_entry(storage, per_layer) if stack.first_member(storage) in per_layer
                    else optax.MaskedNode() for storage in stack.members}

        out_shardings = jax.tree.map(lambda leaf: leaf.sharding, target.arrays())
        return jax.jit(lambda tree: jax.tree.map(convert, tree, is_leaf=per_parameter),
                       out_shardings=out_shardings)(restored)

    def _optimizer_structure(self) -> str:
        return optimizer_structure(abstract_train_state(self.model, self.train_step.optimizer,
                                                        trainable=self.train_step.trainable).opt_state)

    def _capacity_state(self, saved: dict | None) -> CapacityState | None:
        """The saved capacity and calm streak; the ladder depends on ep_size, so a capacity this layout's
        ladder lacks becomes its lowest rung at or above it (capped at the largest), streak reset."""
        if self.model.layout.ep_size == 1:
            return None
        schedule = self.model.capacity_schedule
        if saved is None:
            return schedule.start()
        if any(abs(rung - saved["capacity"]) < 1e-6 for rung in schedule.ladder):
            return CapacityState(schedule.check(saved["capacity"]), int(saved["calm_calls"]),
                                 float(saved["calm_peak"]))
        return CapacityState(min(rung for rung in schedule.ladder if rung >= min(saved["capacity"], schedule.largest)))

    def _step(self, step: int | None) -> int:
        if step is None:
            step = self.manager.latest_step()
            if step is None:
                raise FileNotFoundError(f"{self.directory} holds no complete train-state checkpoint to resume from.")
        return step

    def wait(self) -> None:
        """Block until the last async save is on disk."""
        self.manager.wait_until_finished()
        _UNFINISHED.pop(id(self.manager), None)

    def close(self) -> None:
        """Wait for the last save, then release orbax's background threads (the object is done)."""
        self.wait()
        self.manager.close()
