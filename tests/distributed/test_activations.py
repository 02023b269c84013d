"""The collectives XLA compiles for one decoder layer are the ones the plans imply (activation layouts), and
the logical axis rules table they come from.

One sparse Qwen3-MoE layer is compiled per layout and the collectives of its HLO are read back. The
sequence length (24) is a factor of no weight dimension, so a collective whose shape has a multiple of 24
in it moves activations; any other moves weights.

    tp8 + ep8 all_reduce   colwise -> rowwise: one all-reduce for attention, one for the experts; nothing else
    fsdp8 + ep8            weights all-gathered, activations only through the three dispatch all-to-alls
    tp2 fsdp4 ep4          + one all-reduce (attention, over tp) and one all-gather (TP slices of the tokens)
"""

import json
import re
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax import DistributedConfig
from moe_jax.causal_lm import DeepseekV3ForCausalLM, Qwen3MoeForCausalLM
from moe_jax.distributed.activations import LOGICAL_AXES, UNCONSTRAINED, logical_axis_rules
from moe_jax.distributed.mesh import DeviceLayout
from moe_jax.models.decoder import decoder_layer
from moe_jax.models.step_options import StepOptions
from moe_jax.module_tree import unflatten
from moe_jax.nn.rotary import rope_inverse_frequencies, rope_parameters_from_config, rotary_cos_sin

# Heads divisible by tp=8, one sparse layer.
CONFIG = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
    num_attention_heads=8, num_key_value_heads=8, head_dim=4, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, max_position_embeddings=256,
)
BATCH, SEQUENCE = 8, 24
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
COLLECTIVE = re.compile(
    r"=\s*(\([^)]*\)|\S+)\s+(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)(?:-start)?\("
)


def layer_collectives(layout: dict, *, inference: bool = True) -> Counter:
    """Counter of (collective kind, "activation" | "weight") in the compiled HLO of one decoder layer."""
    model = Qwen3MoeForCausalLM(CONFIG, DistributedConfig(**layout), scan_layers=False)
    model.init_params(seed=0)
    x = jax.device_put(jnp.ones((BATCH, SEQUENCE, CONFIG["hidden_size"])),
                       NamedSharding(model.mesh, P(model.layout.batch_axes)))

    def one_layer(params, x):
        step = StepOptions(
            sharded_experts=model.sharded_experts, capacity=None, inference=inference, rng=None, remat="none",
            layouts=model.activation_layouts,
        )
        inverse_frequencies, scaling = rope_inverse_frequencies(rope_parameters_from_config(model.config.to_dict()))
        positions = jnp.broadcast_to(jnp.arange(SEQUENCE)[None], (BATCH, SEQUENCE))
        rope = rotary_cos_sin(positions, inverse_frequencies, scaling, dtype=x.dtype)
        weights = unflatten(params)["model"]["layers"]["0"]
        mask = jnp.ones((BATCH, SEQUENCE), jnp.int32)
        return decoder_layer(model.family, model.config, weights, x, layer=0, layer_index=0, rope=rope, attention_mask=mask, step=step)[0]

    text = jax.jit(one_layer).lower(model.params, x).compile().as_text()
    counts = Counter()
    for shape, kind in COLLECTIVE.findall(text):
        dims = [int(d) for d in re.findall(r"\d+", re.sub(r"\{[^}]*\}", "", shape.split("]")[0] + "]"))[1:]]
        moves = "activation" if any(d % SEQUENCE == 0 for d in dims) else "weight"
        counts[kind, moves] += 1
    return counts


def test_tp8_with_all_reduce_experts_has_exactly_one_all_reduce_per_block():
    counts = layer_collectives(dict(tp_size=8, ep_size=8, ep_implementation="all_reduce"))
    assert counts == Counter({("all-reduce", "activation"): 2}), counts


def test_auto_takes_all_reduce_at_inference_and_all_to_all_in_training():
    """`auto`'s choice, read from what it compiles: no token moves at inference on a shared-batch group."""
    layout = dict(tp_size=8, ep_size=8, ep_implementation="auto")
    assert layer_collectives(layout, inference=True) == Counter({("all-reduce", "activation"): 2})
    training = layer_collectives(layout, inference=False)
    assert training[("all-to-all", "activation")] == 3 and training[("all-reduce", "activation")] == 1


def test_fsdp8_ep8_gathers_weights_and_moves_activations_only_by_dispatch():
    counts = layer_collectives(dict(fsdp_size=8, ep_size=8))
    activation = {key: n for key, n in counts.items() if key[1] == "activation"}
    assert activation == {("all-to-all", "activation"): 3}, counts
    # q/k/v/o, both layer norms and the router weight are gathered; the experts stay whole per device.
    assert counts[("all-gather", "weight")] == 7, counts
    assert set(counts) == {("all-to-all", "activation"), ("all-gather", "weight")}


def test_tp2_fsdp4_ep4_reduces_once_over_tp_and_gathers_weights_over_fsdp():
    counts = layer_collectives(dict(tp_size=2, fsdp_size=4, ep_size=4))
    activation = {key: n for key, n in counts.items() if key[1] == "activation"}
    assert activation == {
        ("all-reduce", "activation"): 1,   # o_proj partial sums over tp
        ("all-to-all", "activation"): 3,   # dispatch: tokens, expert ids, results
        ("all-gather", "activation"): 1,   # TP ranks' slices of the token outputs
    }, counts
    assert counts[("all-gather", "weight")] >= 7 and ("all-reduce", "weight") not in counts


@pytest.mark.parametrize("layout", [dict(tp_size=2, fsdp_size=4), dict(fsdp_size=8)])
def test_dense_layouts_never_gather_activations(layout):
    counts = layer_collectives(layout)
    assert ("all-gather", "activation") not in counts and ("all-to-all", "activation") not in counts, counts


def test_whole_step_on_fsdp8_ep8_never_gathers_activations():
    """Embedding, routing of every layer, the aux loss and the head: the batch stays where it is."""
    model = Qwen3MoeForCausalLM(dict(CONFIG, num_hidden_layers=2), DistributedConfig(fsdp_size=8, ep_size=8),
                                scan_layers=True)
    model.init_params(seed=0)
    ids = jnp.ones((BATCH, SEQUENCE), jnp.int32)
    text = jax.jit(lambda params, ids: model.apply(params, ids, capacity=2.0)).lower(model.params, ids).compile().as_text()
    gathered = [shape for shape, kind in COLLECTIVE.findall(text)
                if kind == "all-gather" and any(int(d) % SEQUENCE == 0 for d in re.findall(r"\[([\d,]+)\]", shape)[0].split(","))]
    assert gathered == [], gathered


# ---- the rules table (no devices: abstract models) --------------------------------------------------------
def rules_of(model_class, config: dict, **layout) -> dict:
    return dict(model_class(config, DistributedConfig(**layout), abstract=True).logical_axis_rules.rules)


def test_colwise_outputs_map_to_tp_and_the_rest_stays_whole():
    rules = rules_of(Qwen3MoeForCausalLM, CONFIG, tp_size=2, fsdp_size=4, ep_size=4)
    assert set(rules) == set(LOGICAL_AXES)
    batch = ("efsdp", "ep_fsdp")
    assert rules == {
        "batch": batch, "tokens": batch, "length": None, "sequence": None, "embed": None,
        "heads": ("tp",), "kv_heads": ("tp",),   # q/k/v_proj colwise
        "mlp": None,                             # no dense layer: nothing outputs it
        "experts": None, "vocab": None,          # router: no rule; lm_head: colwise_gather_output
        "q_lora": None, "kv_lora": None,
        "head_rows": ("tp",),                    # lm_head's weight: vocab rows split over tp
    }


def test_cp_splits_the_length_and_sequence_parallelism_the_residual_stream_over_tp_too():
    rules = rules_of(Qwen3MoeForCausalLM, CONFIG, tp_size=2, fsdp_size=2, cp_size=2, enable_sequence_parallel=True)
    assert (rules["batch"], rules["length"], rules["sequence"]) == (("efsdp",), ("cp",), ("cp", "tp"))
    assert rules["tokens"] == ("efsdp", "cp") and rules["heads"] == ("tp",) and rules["embed"] is None


def test_the_head_rows_follow_the_weight_the_logits_come_from():
    """head_rows: where tp splits the head's vocab rows, the tied embedding's when tied; none without tp."""
    assert rules_of(Qwen3MoeForCausalLM, CONFIG, tp_size=4, ep_size=4)["head_rows"] == ("tp",)
    assert rules_of(Qwen3MoeForCausalLM, dict(CONFIG, tie_word_embeddings=True), tp_size=4)["head_rows"] == ("tp",)
    assert rules_of(Qwen3MoeForCausalLM, CONFIG, fsdp_size=4, ep_size=4)["head_rows"] is None
    assert rules_of(Qwen3MoeForCausalLM, CONFIG, tp_size=4, tp_plan={"lm_head": "rowwise"})["head_rows"] is None


def test_tp_logits_come_from_the_split_head_not_a_gathered_weight():
    """Given a replicated output, XLA gathered the [V, H] weight and ran the whole head on every tp device; the
    logits stay split over tp where the head's rows are, with the one-device values."""
    model = Qwen3MoeForCausalLM(CONFIG, DistributedConfig(tp_size=4, ep_size=4), devices=jax.devices()[:4])
    model.init_params(seed=0)
    ids = jnp.arange(BATCH * SEQUENCE, dtype=jnp.int32).reshape(BATCH, SEQUENCE) % CONFIG["vocab_size"]
    forward = jax.jit(lambda params, ids: model.apply(params, ids, capacity=2.0).logits)
    text = forward.lower(model.params, ids).compile().as_text()
    weight_shape = f"f32[{CONFIG['vocab_size']},{CONFIG['hidden_size']}]"
    assert not [shape for shape, kind in COLLECTIVE.findall(text) if kind == "all-gather" and weight_shape in shape]
    logits = forward(model.params, ids)
    assert logits.sharding.spec[-1] == "tp"
    one_device = Qwen3MoeForCausalLM(CONFIG, devices=jax.devices()[:1])
    one_device.set_params(model.hf_params())
    np.testing.assert_allclose(np.asarray(logits), np.asarray(one_device.apply(one_device.params, ids).logits),
                               atol=1e-5, rtol=1e-5)


def test_without_tp_only_the_batch_is_split():
    rules = rules_of(Qwen3MoeForCausalLM, CONFIG, fsdp_size=8, ep_size=8)
    assert {name: axes for name, axes in rules.items() if axes} == {"batch": ("ep_fsdp",), "tokens": ("ep_fsdp",)}
    assert rules_of(Qwen3MoeForCausalLM, CONFIG, tp_size=8, ep_size=8)["batch"] is None   # one batch


def test_dense_layers_put_mlp_on_tp():
    config = dict(CONFIG, num_hidden_layers=2, mlp_only_layers=[0])
    rules = rules_of(Qwen3MoeForCausalLM, config, tp_size=2, fsdp_size=4)
    assert rules["mlp"] == ("tp",) and rules["heads"] == ("tp",)


def test_tp_plan_overrides_move_the_axes_their_modules_output():
    """Overrides name HF modules verbatim; the axis of a projection turned replicated (gathered) is whole, and
    one of two modules outputting an axis is enough: k_proj gathered, v_proj colwise -> kv_heads whole."""
    layout = dict(tp_size=2, fsdp_size=4, ep_size=4)
    gathered_q = rules_of(Qwen3MoeForCausalLM, CONFIG, **layout,
                          tp_plan={"model.layers.*.self_attn.q_proj": "colwise_gather_output"})
    assert gathered_q["heads"] is None and gathered_q["kv_heads"] == ("tp",)
    gathered_k = rules_of(Qwen3MoeForCausalLM, CONFIG, **layout,
                          tp_plan={"model.layers.*.self_attn.k_proj": "colwise_gather_output"})
    assert gathered_k["heads"] == ("tp",) and gathered_k["kv_heads"] is None
    split_head = rules_of(Qwen3MoeForCausalLM, CONFIG, **layout, tp_plan={"lm_head": "colwise"})
    assert split_head["vocab"] == ("tp",)


def test_latent_attention_axes_follow_user_rules():
    """DeepSeek-V3's HF plan has no attention rules: heads whole; both MLA up-projections colwise split them."""
    config = json.loads((FIXTURES / "deepseek_v3" / "config.json").read_text())
    layout = dict(tp_size=2, fsdp_size=4)
    rules = rules_of(DeepseekV3ForCausalLM, config, **layout)
    assert (rules["heads"], rules["q_lora"], rules["kv_lora"], rules["mlp"]) == (None, None, None, ("tp",))
    both = {"model.layers.*.self_attn.q_b_proj": "colwise", "model.layers.*.self_attn.kv_b_proj": "colwise"}
    assert rules_of(DeepseekV3ForCausalLM, config, **layout, tp_plan=both)["heads"] == ("tp",)
    only_q = {"model.layers.*.self_attn.q_b_proj": "colwise"}
    assert rules_of(DeepseekV3ForCausalLM, config, **layout, tp_plan=only_q)["heads"] is None


def test_spec_names_one_axis_per_dim_and_leaves_undivided_dims_whole():
    layout = DeviceLayout.from_config(DistributedConfig(tp_size=4, fsdp_size=2))
    rules = logical_axis_rules(layout, {"model.layers.0.self_attn.q_proj": "colwise"},
                               {"model.layers.*.self_attn.q_proj": "heads"})
    assert rules.spec(("batch", "length", "heads"), (8, 24, 32)) == P("efsdp", None, "tp")
    assert rules.spec(("batch", "length", "heads"), (3, 24, 6)) == P(None, None, None)  # 3, 6: undivided
    assert rules.spec(("batch", None)) == P("efsdp", None)
    assert rules.spec(("batch", UNCONSTRAINED), (8, 24)) == P("efsdp", P.UNCONSTRAINED)   # the compiler's choice
    with pytest.raises(KeyError, match="Unknown logical axis 'hidden'"):
        rules.spec(("batch", "hidden"))
    with pytest.raises(ValueError, match="name 2 dims"):
        rules.spec(("batch", "length"), (8, 24, 32))
    with pytest.raises(ValueError, match="output_axes names"):
        logical_axis_rules(layout, {}, {"model.layers.*.self_attn.q_proj": "query"})
