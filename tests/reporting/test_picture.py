"""The layout picture and `moe-jax layout` show the reference doc's table."""

import subprocess
import sys

from moe_jax import DistributedConfig
from moe_jax.cli import main
from moe_jax.reporting.picture import layout_rows


def test_tp2_fsdp4_ep4_rows():
    rows = layout_rows(DistributedConfig(tp_size=2, fsdp_size=4, ep_size=4), num_experts=8)
    assert [row["batch"] for row in rows] == [r // 2 for r in range(8)]
    assert [row["tp"] for row in rows] == [r % 2 for r in range(8)]
    assert [list(row["experts"]) for row in rows] == [[2 * (r % 4), 2 * (r % 4) + 1] for r in range(8)]
    assert [row["efsdp_group"] for row in rows] == [sorted({r, r ^ 4}) for r in range(8)]


def test_layout_command_prints_the_table(capsys):
    assert main(["layout", "--tp", "2", "--fsdp", "4", "--ep", "4", "--num-experts", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = [line.split() for line in lines if line[:1].isdigit() and "devices:" not in line]
    assert table[0] == ["0", "B0", "0", "E0", "E1", "{0,1,2,3}", "{0,4}"]
    assert table[5] == ["5", "B2", "1", "E2", "E3", "{4,5,6,7}", "{1,5}"]
    assert len(table) == 8


def test_invalid_layout_prints_reference_error_and_fails(capsys):
    assert main(["layout", "--tp", "4", "--fsdp", "2", "--ep", "2"]) == 2
    assert "`ep_size` must be a multiple of `tp_size`." in capsys.readouterr().err
    assert main(["layout", "--fsdp", "8", "--ep", "8", "--num-experts", "12"]) == 2
    assert "Cannot evenly shard 12 experts across 8 expert-parallel ranks." in capsys.readouterr().err


def test_console_script_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "moe_jax.cli", "layout", "--tp", "2", "--fsdp", "4", "--ep", "4"],
        capture_output=True, text=True, check=True,
    )
    assert "efsdp_size=2" in result.stdout


def test_the_experts_a_device_stores_are_the_parameter_table_s_per_device_shape():
    """The demo prints both: the layout's header says how many experts a device runs and how many it stores, the
    plan's table the stored per-device shape ([1, ...] of [8, ...] at tp2 fsdp4 ep4)."""
    from moe_jax import AutoModelForCausalLM
    from moe_jax.cli.demo import DEMO_CONFIG, DEMO_LAYOUT
    from moe_jax.reporting.picture import layout_picture

    config = DistributedConfig(**DEMO_LAYOUT)
    header = layout_picture(config, DEMO_CONFIG["num_experts"]).splitlines()[0]
    assert header.endswith("8 experts (2 run per device; each stores 1, gathered over its efsdp group)")
    model = AutoModelForCausalLM.from_config(DEMO_CONFIG, config)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    shape = model.module_tree.params[name].shape
    assert model.named_shardings()[name].shard_shape(shape)[0] == 1
    assert layout_picture(DistributedConfig(fsdp_size=8, ep_size=8), 8).splitlines()[0].endswith("(1 per device)")


def test_cp_rows_name_the_zigzag_chunks_each_device_holds_under_the_model_sharding():
    """--cp 4 --fsdp 2 --ep 4: a device's cp rank and chunks are those of the slice the sequence sharding gives it."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from moe_jax.distributed.context import zigzag_order
    from moe_jax.distributed.mesh import DeviceLayout, build_mesh, spec_entry

    config = DistributedConfig(cp_size=4, fsdp_size=2, ep_size=4)
    rows = layout_rows(config, num_experts=8)
    assert [row["cp"] for row in rows] == [0, 1, 2, 3] * 2
    assert [row["chunks"] for row in rows] == [(r, 7 - r) for r in range(4)] * 2
    assert [row["cp_group"] for row in rows] == [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4
    assert [row["ep_group"] for row in rows] == [row["cp_group"] for row in rows]   # ep groups inside cp
    mesh = build_mesh(config, jax.devices()[:8])
    sharding = NamedSharding(mesh, PartitionSpec(None, spec_entry(DeviceLayout.from_config(config).cp_axes)))
    order = zigzag_order(16, 4)                                   # 8 chunks of 2 tokens
    rank_of = {device: rank for rank, device in enumerate(mesh.devices.flat)}
    for device, (_, slots) in sharding.devices_indices_map((2, 16)).items():
        chunks = sorted(set(order[slots] // 2))
        assert tuple(chunks) == rows[rank_of[device]]["chunks"]


def test_layout_command_draws_the_cp_axis(capsys):
    assert main(["layout", "--cp", "4", "--fsdp", "2", "--ep", "4", "--cp-strategy", "ring"]) == 0
    out = capsys.readouterr().out
    table = [line.split() for line in out.splitlines() if line[:1].isdigit() and "devices:" not in line]
    assert table[1] == ["1", "B0", "1", "S1", "S6", "{0,1,2,3}", "0", "E2", "E3", "{0,1,2,3}", "{1,5}"]
    assert table[7] == ["7", "B1", "3", "S3", "S4", "{4,5,6,7}", "0", "E6", "E7", "{4,5,6,7}", "{3,7}"]
    assert "cp_size=4 (ring)" in out and "multiple of 8" in out and "expert groups span 4 cp ranks" in out
