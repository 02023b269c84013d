"""The collectives XLA compiles for one decoder layer are the ones the plans imply (activation layouts).

One sparse Qwen3-MoE layer is compiled per layout and the collectives of its HLO are read back. The
sequence length (24) is a factor of no weight dimension, so a collective whose shape has a multiple of 24
in it moves activations; any other moves weights.

    tp8 + ep8 all_reduce   colwise -> rowwise: one all-reduce for attention, one for the experts; nothing else
    fsdp8 + ep8            weights all-gathered, activations only through the three dispatch all-to-alls
    tp2 fsdp4 ep4          + one all-reduce (attention, over tp) and one all-gather (TP slices of the tokens)
"""

import re
from collections import Counter
from functools import partial

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax import DistributedConfig
from moe_jax.models import Qwen3MoeForCausalLM
from moe_jax.models.base import StepOptions
from moe_jax.module_tree import unflatten
from moe_jax.nn.rotary import rope_inverse_frequencies, rope_parameters_from_config, rotary_cos_sin

# Heads divisible by tp=8, one sparse layer.
CONFIG = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
    num_attention_heads=8, num_key_value_heads=8, head_dim=4, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, max_position_embeddings=256,
)
BATCH, SEQUENCE = 8, 24
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
            run_experts={layer: partial(experts, inference=inference, capacity=None)
                         for layer, experts in model.sharded_experts.items()},
            inference=inference, rng=None, remat="none", layouts=model.activation_layouts,
        )
        inverse_frequencies, scaling = rope_inverse_frequencies(rope_parameters_from_config(model.config.to_dict()))
        positions = jnp.broadcast_to(jnp.arange(SEQUENCE)[None], (BATCH, SEQUENCE))
        rope = rotary_cos_sin(positions, inverse_frequencies, scaling, dtype=x.dtype)
        weights = unflatten(params)["model"]["layers"]["0"]
        mask = jnp.ones((BATCH, SEQUENCE), jnp.int32)
        return model.decoder_layer(weights, x, layer=0, layer_index=0, rope=rope, attention_mask=mask, step=step)[0]

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
