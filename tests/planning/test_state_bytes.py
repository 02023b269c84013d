"""Each layout's parameter and optimizer bytes are what `moe-jax plan --train` reports for it."""

from pathlib import Path

import jax
import pytest

from moe_jax.causal_lm.auto import AutoModelForCausalLM
from moe_jax.checkpoint_files import read_config
from moe_jax.cli import main
from moe_jax.planning.layouts import enumerate_layouts, quiet_model_building
from moe_jax.planning.search import plan_layouts
from moe_jax.planning.state_bytes import train_state_bytes
from moe_jax.training.memory import human_bytes, train_state_memory
from moe_jax.training.optimizers import build_optimizer, freeze_buffers
from moe_jax.training.state import abstract_train_state

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])   # deepseek_v3 has a buffer: no optimizer state
def test_every_layouts_state_is_the_train_commands(family):
    values = read_config(FIXTURES / family)
    candidates, _ = enumerate_layouts(values, devices=8, batch_size=16, seq_len=32)
    optimizer = build_optimizer("adamw", learning_rate=1e-3)
    with quiet_model_building():
        for candidate in candidates:
            layout = candidate.layout
            model = AutoModelForCausalLM.from_config(values, layout.distributed_config(),
                                                     devices=jax.devices()[:8], **layout.model_options())
            reported = train_state_memory(abstract_train_state(model, freeze_buffers(optimizer, model))).per_device
            state = train_state_bytes(candidate.model, optimizer)
            assert state.parameters == reported["expert parameters"] + reported["dense parameters"], layout.name
            assert state.optimizer == reported["optimizer state"], layout.name


def _per_device_cell(table: str, part: str) -> str:
    line = next(line for line in table.splitlines() if line.strip().startswith(part))
    return [cell.strip() for cell in line.split("  ") if cell.strip()][1]


def test_the_rows_match_the_printed_train_table(capsys):
    checkpoint = FIXTURES / "qwen3_moe"
    plan = plan_layouts(checkpoint, devices=8, batch_size=16, seq_len=32, max_compiles=0)
    for name in ("tp2 ep4 fsdp4 all_to_all", "tp1 ep2 fsdp4 pp2/M4 all_to_all"):
        row = next(estimate for estimate in plan.estimates if estimate.layout.name == name)
        assert main(["plan", "--model", str(checkpoint), *row.layout.flags().split(), "--train"]) == 0
        table = capsys.readouterr().out
        assert _per_device_cell(table, "optimizer state") == human_bytes(row.memory.optimizer)
        assert _per_device_cell(table, "total") == human_bytes(row.memory.parameters + row.memory.optimizer)
