"""The compiled program's kernels and collectives, each counted as many times as it runs."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from moe_jax.planning.hlo_costs import program_costs
from moe_jax.planning.hlo_program import parse_hlo_module, shape_bytes

ROWS, WIDTH, STEPS = 16, 64, 40


def _compiled_scan(dtype):
    """A scan of STEPS (a dot and an all-reduce over 8 devices) on each device's [ROWS, WIDTH] block."""
    mesh = Mesh(np.asarray(jax.devices()[:8]), ("d",))

    def per_device(x, w):
        def step(carry, _):
            return ((carry @ w) * 0.5 + jax.lax.psum(carry, "d") * 0.5).astype(dtype), None
        return jax.lax.scan(step, x, None, length=STEPS)[0]

    program = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d")))
    x = jax.ShapeDtypeStruct((8 * ROWS, WIDTH), dtype)
    w = jax.ShapeDtypeStruct((WIDTH, WIDTH), dtype)
    return parse_hlo_module(program.lower(x, w).compile().as_text())


def test_a_loop_body_counts_once_per_trip():
    costs = program_costs(_compiled_scan(jnp.float32), device_count=8)
    assert costs.flops == STEPS * 2 * ROWS * WIDTH * WIDTH
    reductions = [c for c in costs.collectives if c.kind == "all-reduce"]
    assert sum(c.runs for c in reductions) == STEPS
    assert {c.payload_bytes for c in reductions} == {ROWS * WIDTH * 4}
    assert {c.group_size for c in reductions} == {8}


def test_bfloat16_collectives_count_in_bfloat16_though_xla_cpu_widens_them():
    costs = program_costs(_compiled_scan(jnp.bfloat16), device_count=8)
    assert {c.payload_bytes for c in costs.collectives if c.kind == "all-reduce"} == {ROWS * WIDTH * 2}


def test_shapes_and_tuples():
    assert shape_bytes("(f32[8,32]{1,0}, s32[], /*index=2*/bf16[4]{0})") == 8 * 32 * 4 + 4 + 8
    assert shape_bytes("pred[3]") == 3


TEXT = """HloModule m

%fused (param_0: f32[1024,32], param_1: s32[]) -> f32[256,32] {
  %param_0 = f32[1024,32]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %window = f32[256,32]{1,0} dynamic-slice(%param_0, %param_1, %zero), dynamic_slice_sizes={256,32}
}

%body (p: (s32[], f32[1024,32], s32[5])) -> (s32[], f32[1024,32], s32[5]) {
  %p = (s32[], f32[1024,32]{1,0}, s32[5]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[1024,32]{1,0} get-tuple-element(%p), index=1
  %window = f32[256,32]{1,0} fusion(%x, %i), kind=kLoop, calls=%fused
  ROOT %t = (s32[], f32[1024,32]{1,0}, s32[5]{0}) tuple(%i, %x, %v)
}

%cond (p: (s32[], f32[1024,32], s32[5])) -> pred[] {
  %p = (s32[], f32[1024,32]{1,0}, s32[5]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[1024,32], v: s32[5]) -> f32[1024,32] {
  %a = f32[1024,32]{1,0} parameter(0)
  %v = s32[5]{0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024,32]{1,0}, s32[5]{0}) tuple(%zero, %a, %v)
  %loop = (s32[], f32[1024,32]{1,0}, s32[5]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[1024,32]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_a_data_dependent_tile_loop_runs_its_schedule_times_the_fill_and_reads_only_its_windows():
    costs = program_costs(parse_hlo_module(TEXT), device_count=1, tile_fill=0.8)
    assert costs.bounded_loops == 1
    (window,) = costs.kernels
    assert window.runs == 5 * 0.8
    assert window.bytes == 2 * 256 * 32 * 4 + 4      # the window read and written, and the index


WIDENED_UPDATE = """HloModule m

%update (param_0: bf16[4096,64], param_1: bf16[16,64], param_2: s32[]) -> bf16[4096,64] {
  %param_0 = bf16[4096,64]{1,0} parameter(0)
  %wide = f32[4096,64]{1,0} convert(%param_0)
  %param_1 = bf16[16,64]{1,0} parameter(1)
  %row = f32[16,64]{1,0} convert(%param_1)
  %param_2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %updated = f32[4096,64]{1,0} dynamic-update-slice(%wide, %row, %param_2, %zero)
  ROOT %narrow = bf16[4096,64]{1,0} convert(%updated)
}

ENTRY %main (a: bf16[4096,64], b: bf16[16,64], i: s32[]) -> bf16[4096,64] {
  %a = bf16[4096,64]{1,0} parameter(0)
  %b = bf16[16,64]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %fused = bf16[4096,64]{1,0} fusion(%a, %b, %i), kind=kLoop, calls=%update
  ROOT %copied = bf16[4096,64]{1,0} copy(%fused)
}
"""


def test_an_update_xla_cpu_widened_counts_in_place_for_an_accelerator():
    """XLA:CPU widens a bfloat16 buffer to update 16 rows of it, then copies the result: the whole buffer read
    and written twice there; on an accelerator the 16 rows are written in place and nothing is copied."""
    module = parse_hlo_module(WIDENED_UPDATE)
    on_cpu = program_costs(module, device_count=1)
    assert on_cpu.bytes == 4096 * 64 * 2 + 16 * 64 * 2 + 4 + 4096 * 64 * 2 + 2 * 4096 * 64 * 2
    elsewhere = program_costs(module, device_count=1, cpu_artifacts=False)
    assert elsewhere.bytes == 16 * 64 * 2 + 4 + 16 * 64 * 4     # the new rows read, the index, the rows written
    assert len(elsewhere.kernels) == 1
