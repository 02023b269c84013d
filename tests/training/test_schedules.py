"""Learning-rate schedules (`moe_jax.training.schedules`) against Transformers' schedulers, and the rate an
optimizer built with one applies at each update."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moe_jax.training.optimizers import build_optimizer
from moe_jax.training.schedules import learning_rate_schedule

PEAK, TOTAL, WARMUP = 3e-4, 40, 6


def transformers_rates(name: str, min_lr_ratio: float) -> list[float]:
    torch = pytest.importorskip("torch")
    optimization = pytest.importorskip("transformers.optimization")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    if name == "constant":
        scheduler = optimization.get_constant_schedule_with_warmup(optimizer, WARMUP)
    elif name == "cosine":
        scheduler = optimization.get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, WARMUP, TOTAL, min_lr_rate=min_lr_ratio)
    else:
        assert min_lr_ratio == 0   # Transformers' linear schedule decays to 0
        scheduler = optimization.get_linear_schedule_with_warmup(optimizer, WARMUP, TOTAL)
    rates = []
    for _ in range(TOTAL):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.reference
@pytest.mark.parametrize("name,min_lr_ratio", [("constant", 0.0), ("cosine", 0.0), ("cosine", 0.1), ("linear", 0.0)])
def test_rates_equal_transformers_schedulers(name, min_lr_ratio):
    schedule = learning_rate_schedule(name, PEAK, TOTAL, warmup_steps=WARMUP, min_lr_ratio=min_lr_ratio)
    np.testing.assert_allclose([float(schedule(step)) for step in range(TOTAL)], transformers_rates(name, min_lr_ratio),
                               rtol=1e-5, atol=1e-12)


def test_linear_decay_ends_at_the_min_ratio_and_warmup_starts_at_zero():
    schedule = learning_rate_schedule("linear", PEAK, TOTAL, warmup_steps=WARMUP, min_lr_ratio=0.25)
    assert float(schedule(0)) == 0.0 and float(schedule(WARMUP)) == pytest.approx(PEAK)
    assert float(schedule(TOTAL)) == pytest.approx(0.25 * PEAK)
    assert float(learning_rate_schedule("constant", PEAK)(123)) == pytest.approx(PEAK)


def test_an_optimizer_applies_the_schedule_s_rate_at_each_update():
    schedule = learning_rate_schedule("cosine", 0.5, 10, warmup_steps=2)
    optimizer = build_optimizer("sgd", schedule)
    params = {"w": jnp.zeros(())}
    state = optimizer.init(params)
    for update in range(10):
        updates, state = optimizer.update({"w": jnp.ones(())}, state, params)
        assert float(updates["w"]) == pytest.approx(-float(schedule(update)))
        params = optax.apply_updates(params, updates)


@pytest.mark.parametrize("kwargs,message", [
    (dict(name="step"), "not one of"),
    (dict(warmup_steps=-1), "warmup steps -1"),
    (dict(min_lr_ratio=1.5), r"min_lr_ratio 1.5 must be in \[0, 1\]"),
    (dict(name="constant", min_lr_ratio=0.1), "needs a decaying schedule"),
    (dict(warmup_steps=TOTAL), "leave nothing"),
    (dict(total_steps=None), "needs the run's total steps"),
])
def test_bad_schedules_are_refused(kwargs, message):
    arguments = dict(name="cosine", learning_rate=PEAK, total_steps=TOTAL) | kwargs
    name, rate, total = arguments.pop("name"), arguments.pop("learning_rate"), arguments.pop("total_steps")
    with pytest.raises(ValueError, match=message):
        learning_rate_schedule(name, rate, total, **arguments)
