"""Tiny random HF models (torch) and their logits, for parity tests. Import only under `reference` tests."""

from __future__ import annotations

import chex
import numpy as np

# Logits parity with PyTorch in fp32. The observed max |ours - PyTorch| is 0.9e-7 to 1.5e-7 (fp32 rounding) for
# every family on one device and every legal 8-device layout x ep_implementation (`python
# scripts/checks/check_all_layouts.py` prints the worst); 1e-5 leaves room for another summation order and still
# fails a 1% change to Qwen2-MoE's routed experts (~4e-5, test_fixture_parity.py).
LOGITS_ATOL = 1e-5

TINY_QWEN3_MOE = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
    mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False,
    max_position_embeddings=256,
)

# Qwen2-MoE: dense layer 0, shared experts, q/k/v bias, sliding window on layers 0 and 2 (max_window_layers=3).
TINY_QWEN2_MOE = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
    shared_expert_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=False,
    qkv_bias=True, use_sliding_window=True, sliding_window=4, max_window_layers=3, tie_word_embeddings=False,
    max_position_embeddings=256,
)
# OLMoE: full-width q/k norms with clip_qkv=1.0 (clamps 25-35% of the normalised q/k entries). No pad token:
# HF's default (1) zeroes that embedding row, and a zero hidden state ties all router logits at position 0.
TINY_OLMOE = dict(
    vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, clip_qkv=1.0,
    tie_word_embeddings=False, max_position_embeddings=256, pad_token_id=None, eos_token_id=2,
)
# Mixtral: head_dim (16) != hidden_size / num_attention_heads (8), sliding window 5 on every layer.
TINY_MIXTRAL = dict(
    vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=5,
    router_jitter_noise=0.0, tie_word_embeddings=False, max_position_embeddings=256,
)
# gpt-oss: sliding (window 4) / full / sliding layers, attention sinks, q/k/v/o biases, biased router and
# experts, YaRN over 64 original positions (factor 4), no pad token (as OLMoE).
TINY_GPT_OSS = dict(
    vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
    tie_word_embeddings=False, max_position_embeddings=256, pad_token_id=None, eos_token_id=2,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 64, "rope_theta": 150000.0},
)
# DeepSeek-V3: MLA with q LoRA, v_head_dim (12) != qk head dim (8 + 8), interleaved YaRN rope with mscale_all_dim,
# dense layer 0, group-limited router (4 groups, 2 kept) with a perturbed e_score_correction_bias, a shared expert.
TINY_DEEPSEEK_V3 = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, n_group=4, topk_group=2,
    num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, tie_word_embeddings=False,
    max_position_embeddings=256, eos_token_id=2,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0},
)
# Llama 4 (text): MoE on layers 1 and 3 (shared expert, sigmoid-scaled inputs), dense 0 and 2; RoPE + L2 q/k norm
# + chunked attention (chunks of 4) on layers 0-2, NoPE layer 3 with temperature tuning (floor_scale 4).
TINY_LLAMA4 = dict(
    vocab_size=128, hidden_size=32, intermediate_size=16, intermediate_size_mlp=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2,
    interleave_moe_layer_step=2, attention_chunk_size=4, floor_scale=4, attn_scale=0.5, tie_word_embeddings=False,
    max_position_embeddings=256, pad_token_id=None, eos_token_id=2,
)
# Router weights scaled so top-k choices are far from ties (HF module names differ by family).
ROUTER_WEIGHT_SUFFIXES = ("mlp.gate.weight", "mlp.router.weight", "feed_forward.router.weight")


def tiny_hf_model(model_type: str, config_values: dict, seed: int = 0):
    import torch
    import transformers

    config_class = transformers.AutoConfig.for_model(model_type).__class__
    torch.manual_seed(seed)
    config = config_class(**config_values)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Spread the router so top-k choices are far from ties (a tie could flip between implementations).
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(ROUTER_WEIGHT_SUFFIXES):
                parameter.mul_(20.0)
    return model


def hf_state_dict(model) -> dict[str, np.ndarray]:
    return {name: tensor.detach().cpu().numpy() for name, tensor in model.state_dict().items()}


def hf_logits(model, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    import torch

    with torch.no_grad():
        output = model(
            input_ids=torch.as_tensor(input_ids),
            attention_mask=None if attention_mask is None else torch.as_tensor(attention_mask),
        )
    return output.logits.float().numpy()


def perturb_vector_params(model, scale: float = 0.3, seed: int = 1) -> None:
    """Add N(0, scale^2) noise to every 1-D parameter (norm weights start at 1, biases at 0), so a wrong
    norm or bias layout shows in the logits."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
        for name, buffer in model.named_buffers():  # DeepSeek-V3's router bias starts at 0
            if name.endswith("e_score_correction_bias"):
                buffer.add_(scale * torch.randn(buffer.shape, generator=generator))


def fixture_inputs(vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The inputs of every committed fixture: input_ids [8, 12], attention_mask [8, 12] left-padding rows 1, 5."""
    rng = np.random.default_rng(0)
    input_ids = rng.integers(3, vocab_size, (8, 12))
    attention_mask = np.ones_like(input_ids)
    attention_mask[1, :3] = 0
    attention_mask[5, :7] = 0
    return input_ids, attention_mask


def fixture_arrays(model) -> dict[str, np.ndarray]:
    """What `reference.npz` holds for the HF `model`: its inputs, logits [8, 12, V] and unscaled router aux
    loss (scripts/fixtures/make_model_fixtures.py writes it; test_fixture_drift.py recomputes it)."""
    import torch

    input_ids, attention_mask = fixture_inputs(model.config.vocab_size)
    with torch.no_grad():
        output = model(input_ids=torch.as_tensor(input_ids), attention_mask=torch.as_tensor(attention_mask),
                       output_router_logits=True)
    # A family without a router loss (DeepSeek-V3) records 0, as moe_jax reports it.
    aux_loss = 0.0 if output.aux_loss is None else output.aux_loss.item()
    return dict(input_ids=input_ids, attention_mask=attention_mask, logits=output.logits.float().numpy(),
                aux_loss=np.float32(aux_loss))


LOW_PRECISION_DTYPES = ("bfloat16", "float16")


def low_precision_arrays(checkpoint) -> dict[str, np.ndarray]:
    """What `reference_low_precision.npz` holds: PyTorch's logits [8, 12, V] (as float32) for the fixture's
    inputs with the checkpoint at `checkpoint` loaded in each of LOW_PRECISION_DTYPES (`logits_bfloat16`,
    `logits_float16`): how far the reference's own low-precision run lands from its fp32 logits."""
    import torch
    import transformers

    arrays = {}
    for dtype in LOW_PRECISION_DTYPES:
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
        arrays[f"logits_{dtype}"] = fixture_arrays(model)["logits"]
    return arrays


def hf_named_modules(model) -> list[str]:
    return [name for name, _ in model.named_modules()]


def hf_resolved_plans(model_type: str, config_values: dict, distributed_kwargs: dict) -> dict[str, list]:
    """HF's `_resolve_parallel_plans` on the tiny model built on the meta device:
    {"tp" | "ep" | "fsdp": [(name, style), ...]}."""
    import torch
    import transformers
    from transformers.distributed.configuration_utils import DistributedConfig

    config_class = transformers.AutoConfig.for_model(model_type).__class__
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config_class(**config_values))
    tp, ep, fsdp = model._resolve_parallel_plans(DistributedConfig(**distributed_kwargs))
    return {"tp": list(tp.items()), "ep": list(ep.items()), "fsdp": list(fsdp.items())}


def hf_aux_loss(model, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> float:
    """The unscaled router load-balancing loss HF returns with `output_router_logits=True`."""
    import torch

    with torch.no_grad():
        output = model(
            input_ids=torch.as_tensor(input_ids),
            attention_mask=None if attention_mask is None else torch.as_tensor(attention_mask),
            output_router_logits=True,
        )
    return 0.0 if output.aux_loss is None else float(output.aux_loss)  # DeepSeek-V3 has none


# Checks every family's parity test file runs the same way.
def assert_tree_matches_hf(model, hf_model, state: dict) -> None:
    """Module names in order, and parameter names, shapes and order, equal HF's."""
    assert model.module_tree.named_modules() == hf_named_modules(hf_model)
    assert [(name, spec.shape) for name, spec in model.module_tree.named_parameters()] == [
        (name, tuple(array.shape)) for name, array in state.items()
    ]


def assert_plans_match_hf(model_class, model_type: str, config_values: dict, layout: dict) -> None:
    """Our resolved plans (dict and order) equal HF's `_resolve_parallel_plans` for `layout`."""
    import jax

    from moe_jax import DistributedConfig
    from moe_jax.distributed.mesh import DeviceLayout

    expected = hf_resolved_plans(model_type, config_values, layout)
    config = DistributedConfig(**layout)
    devices = jax.devices()[: DeviceLayout.from_config(config).num_devices]
    plans = model_class(config_values, config, devices=devices).resolved_plans
    assert {"tp": list(plans.tp.items()), "ep": list(plans.ep.items()), "fsdp": list(plans.fsdp.items())} == expected


def assert_padded_batch_matches_hf(model, hf_model, input_ids: np.ndarray, real_tokens_only: bool = False) -> None:
    """With right padding on every other row, logits (all positions, or only real tokens) and the router
    aux loss equal HF's."""
    attention_mask = np.ones_like(input_ids)
    attention_mask[::2, -4:] = 0
    output = model.forward(input_ids, attention_mask)
    logits, expected = np.asarray(output.logits), hf_logits(hf_model, input_ids, attention_mask)
    if real_tokens_only:
        real = attention_mask.astype(bool)
        logits, expected = logits[real], expected[real]
    np.testing.assert_allclose(logits, expected, atol=LOGITS_ATOL, rtol=0)
    assert abs(float(output.aux_loss) - hf_aux_loss(hf_model, input_ids, attention_mask)) < 1e-5


def assert_config_fields_match_hf(config_class, hf_config_class, tiny_values: dict) -> None:
    """Every field our config shares with HF's equals HF's value (lists as tuples), for HF's defaults and for
    `tiny_values`, after a trip through HF's `to_dict`."""
    from dataclasses import fields

    for values in ({}, tiny_values):
        hf = hf_config_class(**values)
        ours = config_class.from_dict(hf.to_dict())
        for name in [f.name for f in fields(ours) if f.name != "raw" and hasattr(hf, f.name)]:
            expected = getattr(hf, name)
            assert getattr(ours, name) == (tuple(expected) if isinstance(expected, list) else expected), name


def assert_loss_gradients_match_pytorch(model, hf_model, state: dict, input_ids: np.ndarray) -> None:
    """One step's gradients of the shifted cross-entropy (HF's loss with labels) for every parameter of
    `hf_model`, from `model` (any layout) holding `state`; our buffers (not torch parameters) get none."""
    import jax
    import jax.numpy as jnp
    import torch

    hf_model.zero_grad()
    hf_model(input_ids=torch.as_tensor(input_ids), labels=torch.as_tensor(input_ids)).loss.backward()
    expected = {name: p.grad.numpy() for name, p in hf_model.named_parameters()}

    model.set_params(state)
    ids = jnp.asarray(input_ids, jnp.int32)

    def loss(params):
        logits = model.apply(params, ids, inference=False).logits[:, :-1]
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(log_probs, ids[:, 1:, None], axis=-1))

    grads = dict(model.hf_params(jax.jit(jax.grad(loss))(model.params)))
    buffers = set(model.module_tree.buffers())
    assert grads.keys() - buffers == expected.keys()
    for name in buffers:
        assert not np.any(np.asarray(grads[name])), name
    chex.assert_trees_all_close({name: np.asarray(grads[name]) for name in expected}, expected, atol=2e-6, rtol=1e-4)
