"""Every family in bf16 / fp16, forward and one train step, judged by what PyTorch's own low-precision run achieves.

The bar for a forward pass: `tests/fixtures/models/<family>/reference_low_precision.npz` holds PyTorch's logits with
the committed checkpoint loaded in bf16 and in fp16 (scripts/fixtures/make_model_fixtures.py); their distance to PyTorch's
fp32 logits (`reference.npz`) is what the reference's own run achieves. Ours, on any layout, must land as close to
those fp32 logits: root-mean-square error within RMS_FACTOR of PyTorch's, and every token's largest error within
MAX_FACTOR of PyTorch's largest, but one token (one token's worst logit is a noisy statistic: measured on one device,
ours is 0.72x-1.17x PyTorch's; and a token whose router sits on a near-tie can pick another expert under another
summation order, which moves its whole expert output: Llama 4's top-1 router does so for one fixture token in bf16,
1.37e-2 against 6.4e-3, while every other token stays within 4.9e-3 of PyTorch's own bf16 logits). That one token
is still bounded, by FLIP_FACTOR.

A train step: one SGD step on the fixture's inputs with the router loss on, at the largest dispatch capacity (no
replay), compared with the same step on one device in fp32 (`train_step_metrics`). Used by
tests/models/test_low_precision.py (a representative set) and scripts/checks/check_dtype_grid.py (every layout).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import moe_jax
from moe_jax import DistributedConfig
from moe_jax.training import make_train_step

from .hf_reference import LOW_PRECISION_DTYPES  # noqa: F401 (the dtypes the fixtures hold; re-exported)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
RMS_FACTOR = 1.25
MAX_FACTOR = 2.0
FLIP_FACTOR = 4.0


@dataclass(frozen=True)
class LogitsError:
    """How far logits are from PyTorch's fp32 logits, over real (non-padding) tokens."""

    max: float
    rms: float
    max_but_one: float  # the largest error of every token but the worst one

    @classmethod
    def between(cls, logits, reference) -> LogitsError:
        real = reference["attention_mask"].astype(bool)
        error = np.asarray(logits, np.float32)[real] - reference["logits"][real]
        per_token = np.sort(np.abs(error).max(axis=-1))
        return cls(float(per_token[-1]), float(np.sqrt(np.mean(np.square(error)))), float(per_token[-2]))

    def within(self, bar: LogitsError) -> bool:
        return (self.rms <= RMS_FACTOR * bar.rms and self.max_but_one <= MAX_FACTOR * bar.max
                and self.max <= FLIP_FACTOR * bar.max)

    def __str__(self) -> str:
        return f"max {self.max:.2e} (all tokens but one: {self.max_but_one:.2e}) rms {self.rms:.2e}"


def fixture_reference(model_type: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / model_type / "reference.npz"))


def reference_error(model_type: str, dtype: str) -> LogitsError:
    """How far PyTorch's own `dtype` run of the fixture lands from its fp32 logits."""
    low = np.load(FIXTURES / model_type / "reference_low_precision.npz")
    return LogitsError.between(low[f"logits_{dtype}"], fixture_reference(model_type))


def load(model_type: str, layout: dict | None, dtype: str):
    """The committed fixture of `model_type` in `dtype`, on `layout` (None: one device)."""
    return moe_jax.AutoModelForCausalLM.from_pretrained(
        FIXTURES / model_type, DistributedConfig(**layout) if layout else None, dtype=dtype,
        devices=jax.devices()[:1] if layout is None else None, progress=False)


def forward_error(model_type: str, layout: dict | None, dtype: str) -> LogitsError:
    """Our `dtype` logits on `layout` against PyTorch's fp32 logits; the output's dtype and dispatch are checked."""
    reference = fixture_reference(model_type)
    output = load(model_type, layout, dtype).forward(reference["input_ids"], reference["attention_mask"])
    assert output.logits.dtype == jnp.dtype(dtype), f"logits in {output.logits.dtype}, model in {dtype}"
    assert int(output.statistics.dropped) == 0
    return LogitsError.between(output.logits, reference)


@dataclass(frozen=True)
class StepResult:
    loss: float
    aux_loss: float
    grad_norm: float
    params: dict[str, np.ndarray]  # after the step, as float32


def train_step_result(model_type: str, layout: dict | None, dtype: str, learning_rate: float = 0.1) -> StepResult:
    """One SGD step of the fixture in `dtype` on `layout`, router loss on, at the largest capacity (no replay)."""
    model = load(model_type, layout, dtype)
    if hasattr(model.config, "output_router_logits"):
        changes = {"output_router_logits": True}
        if hasattr(model.config, "router_aux_loss_coef"):
            changes["router_aux_loss_coef"] = 0.1
        model.config = dataclasses.replace(model.config, **changes)
    train_step = make_train_step(model, optax.sgd(learning_rate))
    capacity = model.capacity_schedule.largest if model.layout.ep_size > 1 else None
    reference = fixture_reference(model_type)
    state, metrics = train_step(train_step.init_state(capacity=capacity),
                                {"input_ids": reference["input_ids"], "attention_mask": reference["attention_mask"]})
    metrics = jax.device_get(metrics)
    assert bool(metrics["applied"]) and int(metrics["dropped"]) == 0
    params = {name: np.asarray(value, np.float32) for name, value in jax.device_get(state.params).items()}
    return StepResult(float(metrics["loss"]), float(metrics["aux_loss"]), float(metrics["grad_norm"]), params)


# A train step on a layout against the one-device fp32 step: in fp32 the same numbers up to summation order;
# in bf16/fp16 within the rounding of a low-precision forward and backward (measured by scripts/checks/check_dtype_grid.py,
# docs/benchmarks.md).
STEP_TOLERANCE = {"float32": dict(loss=1e-5, grad_norm=1e-4, params=1e-5),
                  "bfloat16": dict(loss=1e-2, grad_norm=3e-2, params=None),
                  "float16": dict(loss=2e-3, grad_norm=5e-3, params=None)}


def step_errors(result: StepResult, fp32_one_device: StepResult) -> dict[str, float]:
    """Relative loss / aux-loss / grad-norm errors and the max abs parameter difference after the step."""
    relative = lambda ours, theirs: abs(ours / theirs - 1) if theirs else abs(ours)  # noqa: E731
    return dict(
        loss=relative(result.loss, fp32_one_device.loss),
        aux_loss=relative(result.aux_loss, fp32_one_device.aux_loss),
        grad_norm=relative(result.grad_norm, fp32_one_device.grad_norm),
        params=max(float(np.abs(result.params[name] - value).max()) for name, value in fp32_one_device.params.items()),
    )


def step_within(errors: dict[str, float], dtype: str) -> bool:
    tolerance = STEP_TOLERANCE[dtype]
    return (errors["loss"] <= tolerance["loss"] and errors["aux_loss"] <= tolerance["loss"]
            and errors["grad_norm"] <= tolerance["grad_norm"]
            and (tolerance["params"] is None or errors["params"] <= tolerance["params"])
            and np.isfinite(list(errors.values())).all())
