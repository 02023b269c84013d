"""`build_optimizer("muon")` / `moe-jax train --optimizer muon`: each routed expert's matrix orthogonalised on its
own (straight-line Newton-Schulz per matrix, on one device and on fsdp8/ep8 without gathering the expert stack),
which parameters Muon takes, a tiny run that learns, its state through a checkpoint, and the CLI."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.cli import main
from moe_jax.training import TrainCheckpoints, make_train_step
from moe_jax.training.muon import muon_labels, orthogonalize
from moe_jax.training.optimizers import build_optimizer
from moe_jax.training.state import train_state_shardings

from .conftest import FixtureBatches
from .hf_training import CHECKPOINT

A, B, C = 3.4445, -4.7750, 2.0315   # optax.contrib.muon's coefficients, written out


def straight_line_newton_schulz(matrix: np.ndarray, steps: int = 5) -> np.ndarray:
    """matrix: [O, I] -> [O, I], the Muon iteration written out in float64 (Frobenius pre-scaling; the wide
    orientation)."""
    x = matrix.astype(np.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + 1e-8)
    for _ in range(steps):
        gram = x @ x.T
        x = A * x + (B * gram + C * gram @ gram) @ x
    return x.T if tall else x


def per_matrix(stack: np.ndarray) -> np.ndarray:
    """[..., O, I] -> each trailing matrix through `straight_line_newton_schulz` on its own (a Python loop)."""
    flat = stack.reshape(-1, *stack.shape[-2:])
    return np.stack([straight_line_newton_schulz(m) for m in flat]).reshape(stack.shape)


@pytest.mark.parametrize("shape", [(24, 40), (8, 32, 16), (2, 8, 16, 32)])
def test_orthogonalize_takes_each_trailing_matrix_on_its_own(shape):
    """Dense [O, I], experts [E, O, I] (tall), scanned experts [L, E, O, I] (wide): each matrix as the straight-line
    iteration gives it. Orthogonalising the stack as one [E * O, I] matrix would give another answer."""
    stack = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    stack[..., 0, :] *= 30.0        # uneven rows: a pooled Frobenius norm would differ per matrix
    ours = np.asarray(jax.jit(orthogonalize)(stack))
    np.testing.assert_allclose(ours, per_matrix(stack), atol=1e-5, rtol=0)
    if len(shape) > 2:
        pooled = straight_line_newton_schulz(stack.reshape(-1, shape[-1])).reshape(shape)
        assert np.abs(pooled - ours).max() > 1e-2


def test_the_iteration_is_optax_muons():
    """The same numbers as optax.contrib.muon's own Newton-Schulz on a matrix."""
    from optax.contrib._muon import orthogonalize_via_newton_schulz

    matrix = np.random.default_rng(1).standard_normal((48, 20)).astype(np.float32)
    expected = orthogonalize_via_newton_schulz(jnp.asarray(matrix), jnp.asarray((A, B, C)), 5)
    np.testing.assert_allclose(orthogonalize(matrix), expected, atol=1e-5, rtol=0)


# Storage name -> (shape, expected label): every family's kinds of parameter, scanned and pipelined runs, MTP.
LABELS = {
    "model.embed_tokens.weight": ((128, 32), "adamw"),
    "lm_head.weight": ((128, 32), "adamw"),
    "model.norm.weight": ((32,), "adamw"),
    "model.layers.0.self_attn.q_proj.weight": ((32, 32), "muon"),
    "model.layers.0.self_attn.q_proj.bias": ((32,), "adamw"),
    "model.layers.0.self_attn.q_norm.weight": ((8,), "adamw"),
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": ((24, 32), "muon"),
    "model.layers.0.self_attn.kv_a_layernorm.weight": ((16,), "adamw"),
    "model.layers.0.self_attn.sinks": ((4,), "adamw"),
    "model.layers.0.mlp.gate_proj.weight": ((64, 32), "muon"),
    "model.layers.0.input_layernorm.weight": ((32,), "adamw"),
    "model.layers.1.mlp.gate.weight": ((8, 32), "adamw"),                      # router
    "model.layers.1.mlp.gate.e_score_correction_bias": ((8,), "adamw"),
    "model.layers.1.mlp.router.weight": ((8, 32), "adamw"),
    "model.layers.1.mlp.router.bias": ((8,), "adamw"),
    "model.layers.1.feed_forward.router.weight": ((8, 32), "adamw"),
    "model.layers.1.mlp.shared_expert_gate.weight": ((1, 32), "adamw"),
    "model.layers.1.mlp.shared_experts.down_proj.weight": ((32, 16), "muon"),
    "model.layers.1.mlp.shared_expert.up_proj.weight": ((16, 32), "muon"),
    "model.layers.1.mlp.experts.gate_up_proj": ((8, 32, 32), "muon"),
    "model.layers.1.mlp.experts.down_proj": ((8, 32, 16), "muon"),
    "model.layers.1.mlp.experts.gate_up_proj_bias": ((8, 32), "adamw"),
    "model.layers.1-2.mlp.experts.down_proj": ((2, 8, 32, 16), "muon"),      # scanned run
    "model.layers.1-2.mlp.gate.weight": ((2, 8, 32), "adamw"),
    "model.layers.1-2.post_attention_layernorm.weight": ((2, 32), "adamw"),
    "model.layers.1-2.self_attn.sinks": ((2, 4), "adamw"),                    # a vector per layer, by rank
    "model.layers.pp0-1.self_attn.o_proj.weight": ((2, 32, 32), "muon"),     # pipeline group
    "model.layers.3.eh_proj.weight": ((32, 64), "muon"),                     # DeepSeek-V3 MTP layer
    "model.layers.3.embed_tokens.weight": ((128, 32), "adamw"),
    "model.layers.3.shared_head.head.weight": ((128, 32), "adamw"),
}


def test_muon_takes_the_layers_weight_matrices_and_adamw_the_rest():
    params = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, (shape, _) in LABELS.items()}
    assert muon_labels(params) == {name: label for name, (_, label) in LABELS.items()}


def test_on_fsdp8_ep8_each_device_orthogonalises_its_own_experts(tmp_path):
    """Scanned experts [L, E, O, I], E sharded over ep: the first update of each expert is -lr times its own
    matrix's orthogonalised gradient (the momentum's scale cancels in the normalisation) times
    0.2 * sqrt(max(O, I)); the compiled update gathers no expert stack, and the momentum is laid out as the
    parameter it follows."""
    model = AutoModelForCausalLM.from_pretrained(
        CHECKPOINT, DistributedConfig(fsdp_size=8, ep_size=8, ep_implementation="all_to_all"), scan_layers=True,
        progress=False)
    optimizer = build_optimizer("muon", 1.0)
    shardings = train_state_shardings(model, optimizer)
    experts = [name for name in model.params if ".experts." in name]
    assert experts and all(model.params[name].ndim == 4 for name in experts)
    rng = np.random.default_rng(2)
    grads = {name: jax.device_put(rng.standard_normal(value.shape).astype(np.float32), value.sharding)
             for name, value in model.params.items()}
    state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(model.params)
    update = jax.jit(optimizer.update, out_shardings=(shardings.params, shardings.opt_state))
    compiled = update.lower(grads, state, model.params).compile()
    updates, new_state = compiled(grads, state, model.params)

    for name in experts:
        grad = np.asarray(grads[name])
        scale = 0.2 * max(grad.shape[-2:]) ** 0.5
        np.testing.assert_allclose(np.asarray(updates[name]) / -scale, per_matrix(grad), atol=1e-5, rtol=0,
                                   err_msg=name)
        assert updates[name].sharding.spec == model.params[name].sharding.spec
    momenta = [leaf for leaf in jax.tree.leaves(new_state) if leaf.shape == model.params[experts[0]].shape]
    assert momenta and all(m.sharding == model.params[experts[0]].sharding for m in momenta)

    gathered = [tuple(int(d) for d in dims.split(",")) for dims in re.findall(
        r"=\s*\w+\[([\d,]+)\]\S*\s+all-gather(?:-start)?\(", compiled.as_text())]
    stacks = {model.params[name].shape[-3:] for name in experts}       # [E, O, I] of each stack
    assert gathered, "the fsdp-sharded dense matrices are gathered: the HLO pattern still matches"
    assert not [dims for dims in gathered if dims[-3:] in stacks], gathered


def test_fifty_steps_learn_and_the_state_survives_a_checkpoint(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, devices=jax.devices()[:1], progress=False)
    train_step = make_train_step(model, build_optimizer("muon", 1e-2, 0.01), grad_clip=1.0)
    state, batches = train_step.init_state(), FixtureBatches()
    losses = []
    for index in range(50):
        state, metrics = train_step(state, batches.batch(index))
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and np.mean(losses[-5:]) < losses[0] - 1.0, losses

    checkpoints = TrainCheckpoints(tmp_path, model, train_step)
    checkpoints.save(50, state, None)
    checkpoints.close()
    restored, _ = TrainCheckpoints(tmp_path, model, train_step).restore()
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.opt_state), jax.device_get(state.opt_state))


def test_moe_jax_train_optimizer_muon(capsys):
    """The command trains with it (the flags' path to `build_optimizer`: tests/training/test_optimizers.py)."""
    assert main(["train", "--model", str(CHECKPOINT), "--optimizer", "muon", "--steps", "3", "--batch-size", "4",
                 "--seq-len", "16", "--no-progress"]) == 0
    final_loss = re.search(r"trained steps 1-3 .*final loss ([\d.]+)", capsys.readouterr().out)
    assert final_loss and np.isfinite(float(final_loss[1]))
