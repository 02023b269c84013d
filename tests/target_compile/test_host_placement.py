"""`place_on_host` and the offloaded train program on CPU devices; tests/target_compile/test_gpu_target.py holds
the placement written for abstract GPUs against JAX's own lowering of the offloaded step for a GPU."""

import re

import jax
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.cli.demo import DEMO_CONFIG
from moe_jax.planning.request import PlanRequest
from moe_jax.target_compile.host_placement import offloaded_leaves, place_on_host
from moe_jax.target_compile.programs import train_program
from moe_jax.training.optimizers import build_optimizer
from moe_jax.training.state import abstract_train_state
from moe_jax.training.step import make_train_step
from moe_jax.training.step_options import offload_memory_kinds


@pytest.fixture(scope="module")
def model():
    built = AutoModelForCausalLM.from_config(dict(DEMO_CONFIG), DistributedConfig(fsdp_size=2, ep_size=2),
                                             devices=jax.devices()[:2])
    built.params = built.abstract_params()
    return built


def main_signature(text: str) -> tuple[list[str], list[str]]:
    """The attribute text of each argument and each result of the module's main function."""
    header = text[text.index("func.func public @main("):text.index("{\n", text.index("func.func public @main("))]
    arguments, results = header.split(") -> (", 1)
    split = lambda part: re.split(r"\}, %arg\d+: |\}, tensor<", part)   # noqa: E731
    return split(arguments), split(results)


def host_positions(attributes: list[str]) -> list[int]:
    return [index for index, text in enumerate(attributes) if 'mhlo.memory_kind = "pinned_host"' in text]


def _lowered(model, offload, platforms=None):
    step = make_train_step(model, build_optimizer("adamw", learning_rate=1e-3), offload=offload)
    state = abstract_train_state(model, step.optimizer, model.capacity_schedule.start().capacity,
                                 trainable=step.trainable, memory_kind=step.memory_kind)
    batch = {"input_ids": jax.ShapeDtypeStruct((4, 16), jax.numpy.int32, sharding=model.batch_sharding())}
    traced = step.trace(state, batch)
    return (traced.lower() if platforms is None else traced.lower(lowering_platforms=platforms)), state, batch


def test_the_placement_is_written_into_a_copy_moved_where_the_program_starts():
    mesh = jax.sharding.Mesh(jax.devices()[:2], ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    value = jax.ShapeDtypeStruct((8,), jax.numpy.float32, sharding=sharding)

    def step(weights, moments):
        moments = moments * 0.9 + jax.numpy.sin(weights)
        return weights - moments, moments

    lowered = jax.jit(step).lower(value, value)
    before = lowered.as_text()
    text = place_on_host(lowered, host_arguments=[1], host_results=[1]).as_text()
    assert lowered.as_text() == before       # a copy: JAX caches the lowered program and hands it out again
    arguments, results = main_signature(text)
    assert host_positions(arguments) == host_positions(results) == [1]
    body = text[text.index("func.func public @main("):]
    first = body.splitlines()[1]
    assert "annotate_device_placement(%arg1)" in first and '_xla_buffer_placement = "device"' in first
    assert body.count('_xla_buffer_placement = "pinned_host"') == 1


def test_offloaded_leaves_are_the_parts_chosen_and_never_the_optimizers_counts(model):
    _, state, _ = _lowered(model, None)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    fields = [path[0].name for path, _ in leaves]
    counts = [index for index, (path, leaf) in enumerate(leaves) if path[0].name == "opt_state" and leaf.ndim == 0]
    assert counts      # adamw's step count: replicated on the device whatever is offloaded
    for offload, parts in {"optimizer": {"opt_state"}, "parameters": {"params"},
                           "all": {"params", "opt_state"}}.items():
        expected = [index for index, field in enumerate(fields) if field in parts and index not in counts]
        assert offloaded_leaves(state, offload_memory_kinds(offload)) == expected


def test_indices_outside_the_program_or_a_pruned_program_are_refused(model):
    plain, state, batch = _lowered(model, None)
    count = len(jax.tree.leaves((state, batch)))
    with pytest.raises(ValueError, match=f"the program has {count} arguments"):
        place_on_host(plain, host_arguments=[count], host_results=[])
    with pytest.raises(ValueError, match="dropped unused ones"):
        place_on_host(plain, host_arguments=[0], host_results=[0], argument_count=count + 1)


def test_on_devices_with_host_memory_the_train_program_is_the_offloaded_step(model):
    lowered = train_program(model, PlanRequest(batch_size=4, seq_len=16, offload="optimizer"))
    arguments, _ = main_signature(lowered.as_text())
    _, state, _ = _lowered(model, None)
    assert host_positions(arguments) == offloaded_leaves(state, offload_memory_kinds("optimizer"))


def test_offload_is_a_train_request():
    with pytest.raises(ValueError, match="plan or compile it with --train"):
        PlanRequest(mode="serve", offload="optimizer")
    with pytest.raises(ValueError, match=r"offload='host': choose one of \['all', 'optimizer', 'parameters'\]"):
        PlanRequest(offload="host")
    assert PlanRequest(offload="optimizer").describe().endswith("optimizer state in host memory")
