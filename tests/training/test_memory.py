"""Per-device bytes of parameters and optimizer state, read from the abstract train state's shardings, against
what each layout implies from the parameter shapes and mesh sizes. Nothing is allocated or compiled."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.cli import main
from moe_jax.cli.demo import DEMO_CONFIG
from moe_jax.training.memory import human_bytes, memory_table, train_state_memory
from moe_jax.training.optimizers import build_optimizer
from moe_jax.training.state import abstract_train_state

LAYOUTS = {"fsdp8_ep8": dict(fsdp_size=8, ep_size=8), "tp2_fsdp4_ep4": dict(tp_size=2, fsdp_size=4, ep_size=4)}
ADAM_COUNT_BYTES = 4  # adam's step count: one int32, replicated on every device


def _state(layout: dict | None, optimizer: str = "adamw"):
    devices = jax.devices()[:1] if layout is None else jax.devices()[:8]
    config = None if layout is None else DistributedConfig(**layout)
    model = AutoModelForCausalLM.from_config(DEMO_CONFIG, config, devices=devices)
    return abstract_train_state(model, build_optimizer(optimizer, 1e-3))


def _bytes(leaf) -> int:
    return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize


def _expected_split(name: str, tp: int, fsdp: int, ep: int) -> int:
    """How many ways the layout splits parameter `name`: routed experts [.., E, ..] over ep x efsdp (efsdp =
    fsdp * tp / ep); linear weights over tp x fsdp; norms and the router over fsdp only (no TP rule)."""
    if ".mlp.experts." in name:
        return ep * (fsdp * tp // ep)
    if name.endswith("norm.weight") or name.endswith(".mlp.gate.weight"):
        return fsdp
    return tp * fsdp


def _expected_per_device(params: dict, layout: dict, experts: bool) -> int:
    tp, fsdp, ep = layout.get("tp_size", 1), layout["fsdp_size"], layout["ep_size"]
    total = 0
    for name, leaf in params.items():
        if (".mlp.experts." in name) == experts:
            split = _expected_split(name, tp, fsdp, ep)
            assert _bytes(leaf) % split == 0, name
            total += _bytes(leaf) // split
    return total


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_per_device_bytes_shrink_as_the_layout_implies(layout_name):
    layout = LAYOUTS[layout_name]
    state = _state(layout)
    memory = train_state_memory(state)
    experts = sum(_bytes(leaf) for name, leaf in state.params.items() if ".mlp.experts." in name)
    dense = sum(_bytes(leaf) for name, leaf in state.params.items() if ".mlp.experts." not in name)
    assert memory.unsharded["expert parameters"] == experts and memory.unsharded["dense parameters"] == dense
    # 8 experts over ep x efsdp = 8 devices in both layouts: one expert's rows per device.
    assert memory.per_device["expert parameters"] == experts // 8
    assert memory.per_device["expert parameters"] == _expected_per_device(state.params, layout, experts=True)
    assert memory.per_device["dense parameters"] == _expected_per_device(state.params, layout, experts=False)
    params = memory.per_device["expert parameters"] + memory.per_device["dense parameters"]
    assert memory.per_device["optimizer state"] == 2 * params + ADAM_COUNT_BYTES  # adam's mu and nu
    assert memory.per_device["total"] == 3 * params + ADAM_COUNT_BYTES
    assert memory.unsharded["total"] == 3 * (experts + dense) + ADAM_COUNT_BYTES
    assert memory.num_devices == 8


def test_one_device_holds_the_unsharded_bytes_and_sgd_keeps_no_state():
    one_device = train_state_memory(_state(None))
    assert one_device.per_device == one_device.unsharded and one_device.num_devices == 1
    sharded = train_state_memory(_state(LAYOUTS["fsdp8_ep8"]))
    assert sharded.unsharded == one_device.unsharded
    sgd = train_state_memory(_state(LAYOUTS["fsdp8_ep8"], "sgd"))
    assert sgd.per_device["optimizer state"] == 0 and sgd.unsharded["optimizer state"] == 0
    assert sgd.per_device["total"] == sharded.per_device["expert parameters"] + sharded.per_device["dense parameters"]


def test_table_shows_human_sizes_and_ratios():
    assert [human_bytes(n) for n in (0, 1023, 1536, 3 * 2**20, 5 * 2**40)] == [
        "0 B", "1023 B", "1.5 KiB", "3.0 MiB", "5.0 TiB"]
    table = memory_table(train_state_memory(_state(LAYOUTS["fsdp8_ep8"], "sgd")), "train state (sgd)")
    lines = table.splitlines()
    assert lines[0].startswith("train state (sgd): bytes on the busiest of 8 device(s)")
    assert "0.125 = 1/8" in next(line for line in lines if line.strip().startswith("expert parameters"))
    assert next(line for line in lines if line.strip().startswith("optimizer state")).split()[-1] == "-"


def test_plan_train_appends_the_memory_table(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(DEMO_CONFIG))
    assert main(["plan", "--model", str(tmp_path), "--fsdp", "8", "--ep", "8"]) == 0
    report = capsys.readouterr().out
    assert main(["plan", "--model", str(tmp_path), "--fsdp", "8", "--ep", "8", "--train"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(report)  # the plan report itself is unchanged
    table = out[len(report):].splitlines()
    assert table[1].startswith("train state (adamw, float32 parameters): bytes on the busiest of 8 device(s)")
    rows = {line.strip().split("  ")[0]: line for line in table[3:]}
    assert all(rows[part].endswith("0.125 = 1/8") for part in ("expert parameters", "dense parameters"))
    assert rows["optimizer state"].split()[2:4] == ["250.2", "KiB"] and set(rows) == {
        "expert parameters", "dense parameters", "optimizer state", "total"}

    assert main(["plan", "--model", str(tmp_path), "--tp", "2", "--fsdp", "4", "--ep", "4", "--train",
                 "--optimizer", "sgd"]) == 0
    assert "train state (sgd, float32 parameters)" in capsys.readouterr().out
    assert main(["plan", "--model", str(tmp_path), "--optimizer", "sgd"]) == 2
    assert "--optimizer only applies with --train" in capsys.readouterr().err
