"""`build_optimizer`, the optimizer `moe-jax train --optimizer ...` trains with, against what it promises:
torch.optim.AdamW / torch.optim.SGD (live, `reference`) and plain optax / the SGD formula (always), step
by step on a tiny tree of named parameters, and the CLI's flags reaching it unchanged.

The loss-curve tests build their own optimizer (tests/training/conftest.py: `reference_optimizer`), so
without these a changed AdamW epsilon or beta, an ignored weight decay, SGD momentum, or the expert
learning rate applied to the wrong parameters would go unnoticed.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moe_jax.cli import main
from moe_jax.training.optimizers import build_optimizer

from .hf_training import CHECKPOINT

# Storage names as the models use them; the routed experts (`mlp.experts.*`) are written out here rather
# than derived from the library's marker, so a wrong split fails. `shared_experts` are dense. Both
# optimizers work entry by entry, so every parameter has one small shape (eager ops compile once).
NAMES = (
    "model.embed_tokens.weight",
    "model.layers.0.mlp.gate.weight",
    "model.layers.0.mlp.experts.gate_up_proj",
    "model.layers.0.mlp.experts.down_proj",
    "model.layers.0.mlp.shared_experts.down_proj.weight",
    "model.norm.weight",
)
SHAPE = (4, 6)
ROUTED_EXPERTS = {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
STEPS = 4
LR, EXPERT_LR, WEIGHT_DECAY = 1e-2, 3e-3, 0.1
# Float32 rounding between implementations is a few 1e-7 on parameters of order 1. The bugs these tests
# exist for move some parameter by far more over 4 steps: eps 1e-8 -> 1e-7 changes the update of an entry
# whose gradients are ~1e-7 by ~lr/2 per step (~2e-2 in all); ignored weight decay ~lr*wd*|p| per step
# (~4e-3 on |p| ~ 1); momentum 0.9 in SGD ~lr*|g|; the other learning rate on a group ~(lr - expert lr)*|g|.
ATOL = 2e-6


def params_and_gradients(seed: int = 0) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """Random float32 parameters named `NAMES` and `STEPS` random gradients of them. Each entry's gradients
    keep one scale for every step, from 1 down to 1e-7: where |g| ~ 1e-7 Adam's epsilon (1e-8) is a tenth of
    the denominator, so a changed epsilon shows; the signs change from step to step, so momentum shows."""
    rng = np.random.default_rng(seed)
    params = {name: rng.standard_normal(SHAPE).astype(np.float32) for name in NAMES}
    scales = {name: 10.0 ** rng.integers(-7, 1, SHAPE) for name in NAMES}
    gradients = [{name: (rng.standard_normal(SHAPE) * scales[name]).astype(np.float32) for name in NAMES}
                 for _ in range(STEPS)]
    return params, gradients


def plain_adamw(learning_rate: float, weight_decay: float) -> optax.GradientTransformation:
    """optax AdamW with torch.optim.AdamW's default betas and epsilon, and the given decoupled decay."""
    return optax.adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)


def run_optax(optimizer: optax.GradientTransformation, params, gradients) -> dict[str, np.ndarray]:
    """The parameters after applying `optimizer` to `gradients` one step at a time."""
    params = {name: jnp.asarray(value) for name, value in params.items()}
    state = optimizer.init(params)
    for grads in gradients:
        updates, state = optimizer.update({name: jnp.asarray(g) for name, g in grads.items()}, state, params)
        params = optax.apply_updates(params, updates)
    return jax.tree.map(np.asarray, params)


def run_torch(make_optimizer, params, gradients, expert_lr: float | None = None) -> dict[str, np.ndarray]:
    """The same with a torch optimizer; with `expert_lr`, the routed experts are a parameter group of their
    own."""
    import torch

    tensors = {name: torch.nn.Parameter(torch.tensor(value)) for name, value in params.items()}
    if expert_lr is None:
        groups = list(tensors.values())
    else:
        groups = [{"params": [t for n, t in tensors.items() if n in ROUTED_EXPERTS], "lr": expert_lr},
                  {"params": [t for n, t in tensors.items() if n not in ROUTED_EXPERTS]}]
    optimizer = make_optimizer(groups)
    for grads in gradients:
        for name, tensor in tensors.items():
            tensor.grad = torch.tensor(grads[name])
        optimizer.step()
    return {name: tensor.detach().numpy() for name, tensor in tensors.items()}


def assert_params_close(actual: dict, expected: dict):
    assert actual.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=0, atol=ATOL, err_msg=name)


def split_expected(experts: dict, dense: dict) -> dict:
    """Routed experts' entries from `experts`, every other entry from `dense` (both per-leaf optimizers)."""
    return {name: (experts if name in ROUTED_EXPERTS else dense)[name] for name in dense}


def test_the_gradients_exercise_epsilon():
    """Guards the premise of the AdamW tests: some entries' gradients stay small enough for eps to matter."""
    params, gradients = params_and_gradients()
    for name in NAMES:
        largest = np.max([np.abs(g[name]) for g in gradients], axis=0)
        assert np.any(largest < 1e-6), name


def test_adamw_is_optax_adamw_with_pytorch_defaults_and_decoupled_decay():
    """`adamw`: b1 0.9, b2 0.999, eps 1e-8, decoupled weight decay on every parameter (norms too). Fails on a
    changed beta or epsilon, an ignored or rescaled weight decay, or the learning rate not passed through."""
    params, gradients = params_and_gradients()
    ours = run_optax(build_optimizer("adamw", LR, WEIGHT_DECAY), params, gradients)
    expected = run_optax(plain_adamw(LR, WEIGHT_DECAY), params, gradients)
    assert_params_close(ours, expected)


def test_adamw_without_weight_decay_decays_nothing():
    """`weight_decay=None` (the CLI's default) is no decay, not optax's or torch's default of 1e-4 / 1e-2."""
    params, gradients = params_and_gradients(1)
    ours = run_optax(build_optimizer("adamw", LR), params, gradients)
    expected = run_optax(plain_adamw(LR, 0.0), params, gradients)
    assert_params_close(ours, expected)


def test_adamw_expert_learning_rate_applies_to_the_routed_experts_only():
    """`expert_learning_rate`: the routed experts' weights (not `shared_experts`, not the router) get it,
    every other parameter the learning rate; weight decay on both. Fails on a swapped or ignored expert rate,
    or on a split that puts a dense parameter with the experts or the reverse."""
    params, gradients = params_and_gradients(2)
    optimizer = build_optimizer("adamw", LR, WEIGHT_DECAY, expert_learning_rate=EXPERT_LR)
    ours = run_optax(optimizer, params, gradients)
    expected = split_expected(run_optax(plain_adamw(EXPERT_LR, WEIGHT_DECAY), params, gradients),
                              run_optax(plain_adamw(LR, WEIGHT_DECAY), params, gradients))
    assert_params_close(ours, expected)


@pytest.mark.parametrize("expert_lr", [None, EXPERT_LR])
def test_sgd_is_plain_gradient_descent(expert_lr):
    """`sgd`: p - lr * g each step, nothing else (no momentum, no decay); the experts at their own rate when
    given. Computed here in float64 from the formula."""
    params, gradients = params_and_gradients(3)
    ours = run_optax(build_optimizer("sgd", LR, expert_learning_rate=expert_lr), params, gradients)
    expected = {}
    for name, value in params.items():
        lr = expert_lr if expert_lr is not None and name in ROUTED_EXPERTS else LR
        expected[name] = value.astype(np.float64) - lr * sum(g[name].astype(np.float64) for g in gradients)
    assert_params_close(ours, expected)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="plain SGD"):
        build_optimizer("sgd", LR, 0.1)
    build_optimizer("sgd", LR, 0.0)                              # zero decay is no decay: accepted
    with pytest.raises(ValueError, match="not one of"):
        build_optimizer("adam", LR)
    with pytest.raises(ValueError, match="must be > 0"):
        build_optimizer("adamw", 0.0)
    with pytest.raises(ValueError, match="expert learning rate -0.001 must be > 0"):
        build_optimizer("adamw", LR, expert_learning_rate=-1e-3)
    with pytest.raises(ValueError, match="weight decay -0.01 must be >= 0"):
        build_optimizer("adamw", LR, -0.01)


@pytest.mark.reference
@pytest.mark.parametrize("weight_decay", [None, WEIGHT_DECAY])
@pytest.mark.parametrize("expert_lr", [None, EXPERT_LR])
def test_adamw_steps_as_torch_adamw(weight_decay, expert_lr):
    """`moe-jax train --optimizer adamw [--weight-decay] [--expert-lr]` against torch.optim.AdamW with the
    betas and epsilon the docs promise (PyTorch's defaults), the experts as a parameter group of their own."""
    import torch

    params, gradients = params_and_gradients(4)
    optimizer = build_optimizer("adamw", LR, weight_decay, expert_learning_rate=expert_lr)
    ours = run_optax(optimizer, params, gradients)
    expected = run_torch(lambda groups: torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8,
                                                          weight_decay=weight_decay or 0.0),
                         params, gradients, expert_lr)
    assert_params_close(ours, expected)


@pytest.mark.reference
@pytest.mark.parametrize("expert_lr", [None, EXPERT_LR])
def test_sgd_steps_as_torch_sgd(expert_lr):
    """`--optimizer sgd [--expert-lr]` against torch.optim.SGD without momentum or decay."""
    import torch

    params, gradients = params_and_gradients(5)
    ours = run_optax(build_optimizer("sgd", LR, expert_learning_rate=expert_lr), params, gradients)
    expected = run_torch(lambda groups: torch.optim.SGD(groups, lr=LR, momentum=0.0, weight_decay=0.0),
                         params, gradients, expert_lr)
    assert_params_close(ours, expected)


class _Stop(Exception):
    """Ends the job once the train step is being built: nothing is compiled or trained."""


@pytest.mark.parametrize("flags, expected", [
    (["--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.05", "--expert-lr", "0.0007",
      "--grad-accum", "2", "--grad-clip", "0.5"],
     (dict(name="adamw", learning_rate=0.003, weight_decay=0.05, expert_learning_rate=0.0007),
      dict(grad_accum=2, grad_clip=0.5))),
    (["--optimizer", "muon", "--lr", "0.02", "--weight-decay", "0.1"],
     (dict(name="muon", learning_rate=0.02, weight_decay=0.1, expert_learning_rate=None),
      dict(grad_accum=1, grad_clip=1.0))),
    (["--optimizer", "sgd", "--lr", "0.25", "--grad-clip", "0"],
     (dict(name="sgd", learning_rate=0.25, weight_decay=None, expert_learning_rate=None),
      dict(grad_accum=1, grad_clip=None))),
])
def test_the_cli_flags_reach_build_optimizer_and_the_step_unchanged(flags, expected, monkeypatch):
    """`moe-jax train`'s --optimizer / --lr / --weight-decay / --expert-lr are what `build_optimizer` gets,
    and its optimizer (with --grad-accum / --grad-clip) is what the train step gets: a flag dropped,
    swapped or defaulted on the way fails."""
    import moe_jax.training.optimizers as optimizers
    import moe_jax.training.step as step

    calls = {}
    real_build = optimizers.build_optimizer

    def recording_build(*args, **kwargs):
        bound = inspect.signature(real_build).bind(*args, **kwargs)
        bound.apply_defaults()
        calls["build"] = bound.arguments
        calls["optimizer"] = real_build(*args, **kwargs)
        return calls["optimizer"]

    def recording_step(model, optimizer, **kwargs):
        calls["step"] = (optimizer, kwargs)
        raise _Stop

    monkeypatch.setattr(optimizers, "build_optimizer", recording_build)
    monkeypatch.setattr(step, "make_train_step", recording_step)
    with pytest.raises(_Stop):
        main(["train", "--model", str(CHECKPOINT), "--steps", "1", "--no-progress", *flags])
    build_arguments, step_kwargs = expected
    assert calls["build"] == build_arguments
    optimizer, kwargs = calls["step"]
    assert optimizer is calls["optimizer"]
    assert {name: kwargs[name] for name in step_kwargs} == step_kwargs
