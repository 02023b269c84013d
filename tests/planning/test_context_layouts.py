"""Context parallelism in the planner: cp layouts are enumerated for long training sequences (a multiple of
2 x cp, at least CP_MIN_SEQ_LEN), ranked, their activations guessed below the cp=1 ones, and they compile."""

from pathlib import Path

import jax
import pytest

from moe_jax import AutoModelForCausalLM
from moe_jax.checkpoint_files import read_config
from moe_jax.cli import main
from moe_jax.planning import plan_layouts
from moe_jax.planning.analytic import activation_bytes_guess, analytic_step_seconds
from moe_jax.planning.compiled_step import compile_layout_step
from moe_jax.planning.hardware import load_hardware
from moe_jax.planning.layouts import CP_MIN_SEQ_LEN, Candidate, Layout, ep_sizes, layout_space
from moe_jax.planning.request import PlanRequest
from moe_jax.planning.state_bytes import train_state_bytes
from moe_jax.training.optimizers import build_optimizer

CHECKPOINT = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3_moe"


def test_cp_layouts_are_tried_only_for_long_training_sequences_they_split():
    assert not any(layout.cp > 1 for layout in layout_space(8, "train", CP_MIN_SEQ_LEN // 2))
    assert not any(layout.cp > 1 for layout in layout_space(8, "serve", CP_MIN_SEQ_LEN))
    long = layout_space(8, "train", CP_MIN_SEQ_LEN)
    assert {layout.cp for layout in long} == {1, 2, 4, 8}
    assert {layout.cp_strategy for layout in long if layout.cp > 1} == {"all_gather", "ring"}
    assert all(layout.pp == 1 and layout.devices == 8 for layout in long if layout.cp > 1)
    assert {layout.cp for layout in layout_space(8, "train", CP_MIN_SEQ_LEN + 8)} == {1, 2, 4}   # not 16 chunks
    # expert groups nest in cp: ep / tp divides cp, or is cp x a divisor of fsdp (DistributedConfig's rule)
    assert ep_sizes(1, 2, 4) == [1, 2, 4, 8] and ep_sizes(2, 1, 2) == [1, 2, 4]


def test_a_cp_layout_flags_and_config_name_its_size_and_strategy():
    layout = Layout(1, 4, 2, 1, 1, "all_to_all", cp=4, cp_strategy="ring")
    assert layout.devices == 8 and layout.name == "tp1 ep4 fsdp2 cp4/ring all_to_all"
    assert "--cp 4 --cp-strategy ring" in layout.flags()
    config = layout.distributed_config()
    assert (config.cp_size, config.cp_strategy, config.ep_size) == (4, "ring", 4)
    assert Layout(1, 1, 8, 1, 1).config_sizes()["cp_size"] == 1


def test_plan_train_on_a_long_sequence_ranks_cp_layouts_first_by_the_guess():
    """2 sequences of 8192 tokens on 8 devices: the batch splits over 2 groups at most; cp uses the rest."""
    plan = plan_layouts(CHECKPOINT, devices=8, batch_size=2, seq_len=8192, max_compiles=0)
    assert plan.estimates[0].layout.cp > 1
    assert any(row["distributed_config"]["cp_size"] == 4 for row in plan.as_json()["layouts"])
    short = plan_layouts(CHECKPOINT, devices=8, batch_size=2, seq_len=2048, max_compiles=0)
    assert all(estimate.layout.cp == 1 for estimate in short.estimates)


def _candidate(layout: Layout, request: PlanRequest) -> Candidate:
    model = AutoModelForCausalLM.from_config(read_config(CHECKPOINT), layout.distributed_config(), abstract=True,
                                             **request.model_options())
    return Candidate(layout, model)


def test_cp_divides_the_guessed_activations_and_adds_the_key_value_exchange():
    request = PlanRequest(mode="train", batch_size=4, seq_len=8192)
    flat, split, ring = (_candidate(layout, request) for layout in (
        Layout(1, 1, 4, 1, 1), Layout(1, 1, 4, 1, 1, cp=2), Layout(1, 1, 4, 1, 1, cp=2, cp_strategy="ring")))
    guesses = [activation_bytes_guess(candidate, request) for candidate in (flat, split, ring)]
    assert guesses[2] == pytest.approx(guesses[0] / 2)           # ring: only its half of each sequence
    assert guesses[2] < guesses[1] < guesses[0]                  # all_gather: plus the keys and values gathered
    profile, state = load_hardware("h100"), train_state_bytes(flat.model, build_optimizer("adamw", learning_rate=1e-3))
    seconds = [analytic_step_seconds(candidate, state, request, profile, 8) for candidate in (flat, split)]
    assert seconds[1] < seconds[0]       # twice the devices; the cp exchange costs less than the halved work


# heavy: two train steps compiled (about 8 s on 2 cores)
@pytest.mark.heavy
def test_a_cp_layout_compiles_with_less_activation_memory_than_without_cp():
    request = PlanRequest(mode="train", batch_size=4, seq_len=512)
    values = read_config(CHECKPOINT)
    flat = compile_layout_step(values, Layout(1, 1, 4, 1, 1), request, jax.devices())
    split = compile_layout_step(values, Layout(1, 1, 4, 1, 1, cp=2), request, jax.devices())
    assert split.peak.forward < flat.peak.forward


def test_plan_auto_train_prints_a_cp_layout_and_its_command(capsys):
    assert main(["plan", "--auto", "--train", "--model", str(CHECKPOINT), "--devices", "8", "--batch-size", "2",
                 "--seq-len", "8192", "--max-compiles", "0", "--no-cache", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "cp4/all_gather" in out and "cp size" in out
    assert main(["plan", "--auto", "--train", "--model", str(CHECKPOINT), "--devices", "8", "--cp", "2"]) == 2
    assert "drop --cp" in capsys.readouterr().err
