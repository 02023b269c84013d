"""The planner's arithmetic pinned to hand-computed values: the ranking order, the state one device holds and
the fewest devices on which it fits.

The model: the tiny Qwen3-MoE fixture widened so that every size divides by 3 (hidden 48, 3 heads of 8, 6
experts), so three devices split all of it but the q/k norms (head_dim 8 does not divide by 3).
"""

from pathlib import Path

from moe_jax.checkpoint_files import read_config
from moe_jax.planning.estimate import LayoutEstimate, MemoryBreakdown
from moe_jax.planning.layouts import Layout, enumerate_layouts
from moe_jax.planning.min_devices import state_bound, state_of
from moe_jax.planning.request import PlanRequest
from moe_jax.planning.state_bytes import train_state_bytes
from moe_jax.training.optimizers import build_optimizer

CHECKPOINT = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3_moe"
DIVISIBLE_BY_3 = {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3, "intermediate_size": 96,
                  "moe_intermediate_size": 24, "num_local_experts": 6, "vocab_size": 96, "num_hidden_layers": 3}
HIDDEN, HEAD_DIM, VOCAB, INTERMEDIATE, MOE_INTERMEDIATE, EXPERTS = 48, 8, 96, 96, 24, 6


def hand_parameter_count() -> tuple[int, int]:
    """(parameters, of them the ones 3 devices cannot split: the q/k norms of head_dim 8), counted by hand."""
    attention = 4 * 3 * HEAD_DIM * HIDDEN + 2 * HEAD_DIM          # q, k, v, o; q_norm, k_norm
    norms = 2 * HIDDEN
    dense_layer = attention + 3 * INTERMEDIATE * HIDDEN + norms
    sparse_layer = attention + EXPERTS * 3 * MOE_INTERMEDIATE * HIDDEN + EXPERTS * HIDDEN + norms
    total = 2 * VOCAB * HIDDEN + HIDDEN + dense_layer + 2 * sparse_layer    # mlp_only_layers = [0]
    return total, 3 * 2 * HEAD_DIM


PARAMETERS, UNSPLIT = hand_parameter_count()
PER_DEVICE_OF_3 = (PARAMETERS - UNSPLIT) // 3 + UNSPLIT     # parameters one of 3 fsdp devices stores
ADAM_COUNT = 4                                             # AdamW's int32 step count, held whole


def config() -> dict:
    return {**read_config(CHECKPOINT), **DIVISIBLE_BY_3}


def fsdp_candidate(devices: int, dtype: str = "float32"):
    candidates, _ = enumerate_layouts(config(), devices=devices, batch_size=12, seq_len=8,
                                      model_options={"dtype": dtype, "remat": "none"})
    return next(c for c in candidates if c.layout == Layout(1, 1, devices, 1, 1))


def test_the_hand_count_is_the_models():
    assert PARAMETERS == 79296
    state = train_state_bytes(fsdp_candidate(1).model, build_optimizer("adamw", 1e-3))
    assert state.parameters == 4 * PARAMETERS


def test_gradients_are_float32_whatever_the_parameters_dtype():
    """bfloat16 parameters: 2 bytes each stored, their gradients summed in float32, 4 bytes each."""
    state = train_state_bytes(fsdp_candidate(3, "bfloat16").model, build_optimizer("adamw", 1e-3))
    assert state.parameters == 2 * PER_DEVICE_OF_3 == 52928
    assert state.gradients == 4 * PER_DEVICE_OF_3 == 105856


def test_the_train_state_counts_parameters_gradients_and_both_moments():
    state = train_state_bytes(fsdp_candidate(3).model, build_optimizer("adamw", 1e-3))
    assert (state.parameters, state.gradients, state.optimizer) == (
        4 * PER_DEVICE_OF_3, 4 * PER_DEVICE_OF_3, 2 * 4 * PER_DEVICE_OF_3 + ADAM_COUNT)
    assert state_of(fsdp_candidate(3), PlanRequest(mode="train"), build_optimizer("adamw", 1e-3)) == state.total
    assert state_of(fsdp_candidate(3), PlanRequest(mode="serve"), build_optimizer("adamw", 1e-3)) == state.parameters


TRAIN_STATE_OF_3 = 4 * 4 * PER_DEVICE_OF_3 + ADAM_COUNT     # 423428 bytes: float32 parameters, gradients, 2 moments


def _bound(mode: str, usable: int, start: int = 1) -> int | None:
    request = PlanRequest(mode=mode, batch_size=12, seq_len=8)
    optimizer = build_optimizer("adamw", 1e-3)
    count, _ = state_bound(config(), request, start=start, usable_bytes=usable, optimizer=optimizer,
                           one_device_state=state_of(fsdp_candidate(1), request, optimizer))
    return count


def test_a_train_state_that_needs_exactly_three_devices_answers_three():
    """Two devices hold half the state (634372 bytes) and four a quarter: a device of exactly the 3-device
    state's bytes answers 3, one byte less 4."""
    assert TRAIN_STATE_OF_3 == 423428
    assert _bound("train", TRAIN_STATE_OF_3) == 3
    assert _bound("train", TRAIN_STATE_OF_3 - 1) == 4


def test_serving_counts_the_parameters_alone():
    assert _bound("serve", 4 * PER_DEVICE_OF_3) == 3
    assert _bound("serve", 4 * PER_DEVICE_OF_3 - 1) == 4


def test_the_search_starts_above_the_count_already_planned():
    """`start` devices were planned and none fit there: the answer is a larger count even when the state alone
    would fit at `start` (its activations did not)."""
    assert _bound("train", TRAIN_STATE_OF_3, start=3) == 4
    assert _bound("train", TRAIN_STATE_OF_3, start=2) == 3


def _estimate(name: str, seconds: float | None, total: int, compiled: bool = True, usable: int = 100):
    layout = Layout(1, 1, 8, 1, 1, "auto", None) if name == "fsdp" else Layout(
        int(name[2]), 1, 8 // int(name[2]), 1, 1)
    memory = MemoryBreakdown(total, 0, 0, 0 if compiled else None, 0 if compiled else None, total)
    return LayoutEstimate(layout, memory, usable, seconds, compiled=compiled)


def test_fitting_layouts_rank_by_step_time_and_memory_breaks_ties():
    slow_small = _estimate("tp1", 2.0, 10)
    fast_large = _estimate("tp2", 1.0, 50)
    fast_small = _estimate("tp4", 1.0, 20)
    too_big = _estimate("tp8", 0.5, 200)
    ranked = sorted([slow_small, too_big, fast_large, fast_small], key=LayoutEstimate.sort_key)
    assert ranked == [fast_small, fast_large, slow_small, too_big]


def test_not_compiled_layouts_rank_after_every_compiled_one_and_fit_unknown():
    compiled_too_big = _estimate("tp1", 3.0, 300)
    unknown = _estimate("tp2", None, 10, compiled=False)
    fitting = _estimate("tp4", 9.0, 90)
    assert sorted([unknown, compiled_too_big, fitting], key=LayoutEstimate.sort_key) == [
        fitting, compiled_too_big, unknown]
    assert (fitting.fits, compiled_too_big.fits, unknown.fits) == (True, False, None)
