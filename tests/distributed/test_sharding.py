"""Parameter PartitionSpecs derived from resolved plans place the reference's slices on each device."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax import DistributedConfig
from moe_jax.distributed.mesh import DeviceLayout, build_mesh
from moe_jax.distributed.plans import resolve_parallel_plans
from moe_jax.distributed.sharding import parameter_sharding, parameter_shardings

from .test_mesh import LAYOUTS
from .tiny_qwen3_moe import TinyQwen3MoeForCausalLM


def shardings_for(**kwargs):
    config = DistributedConfig(**kwargs)
    model = TinyQwen3MoeForCausalLM()
    return config, parameter_shardings(model.module_tree, resolve_parallel_plans(model, config), config)


def test_specs_tp2_fsdp4_ep4():
    _, shardings = shardings_for(tp_size=2, fsdp_size=4, ep_size=4)
    assert shardings["model.layers.1.self_attn.q_proj.weight"].spec == P(("tp", "efsdp", "ep_fsdp"), None)
    assert shardings["model.layers.1.self_attn.o_proj.weight"].spec == P(("efsdp", "ep_fsdp"), "tp")
    assert shardings["model.layers.1.mlp.experts.gate_up_proj"].spec == P(("ep_fsdp", "tp", "efsdp"), None, None)
    assert shardings["model.layers.1.mlp.experts.gate_up_proj"].local_shape == (1, 32, 32)
    assert shardings["model.embed_tokens.weight"].spec == P(("tp", "efsdp", "ep_fsdp"), None)
    # q_norm is replicated over tp but FSDP-sharded, as the reference's root fully_shard does.
    assert shardings["model.layers.1.self_attn.q_norm.weight"].spec == P(("efsdp", "ep_fsdp"))
    assert shardings["lm_head.weight"].spec == P(("tp", "efsdp", "ep_fsdp"), None)


def test_tp_only_shards_experts_by_packed_colwise_and_rowwise():
    _, shardings = shardings_for(tp_size=2)
    assert shardings["model.layers.1.mlp.experts.gate_up_proj"].spec == P(None, "tp", None)
    assert shardings["model.layers.1.mlp.experts.down_proj"].spec == P(None, None, "tp")
    assert shardings["model.layers.1.mlp.gate.weight"].spec == P(None, None)


def test_no_parallelism_replicates_everything():
    _, shardings = shardings_for()
    assert all(s.spec == P(*(None,) * len(s.shape)) for s in shardings.values())


@pytest.mark.parametrize("tp, fsdp, ep, replicate", LAYOUTS)
def test_expert_shards_hold_the_devices_experts(tp, fsdp, ep, replicate):
    """Each device's slice of an expert weight is its EP block's experts, FSDP-split over efsdp."""
    config, shardings = shardings_for(tp_size=tp, fsdp_size=fsdp, ep_size=ep, dp_replicate_size=replicate)
    layout = DeviceLayout.from_config(config)
    mesh = build_mesh(config)
    sharding = shardings["model.layers.1.mlp.experts.gate_up_proj"]
    experts = 8
    array = jax.device_put(
        np.arange(experts, dtype=np.float32)[:, None, None] * np.ones(sharding.shape, np.float32),
        NamedSharding(mesh, sharding.spec),
    )
    for shard in array.addressable_shards:
        rank = shard.device.id
        held = sorted({int(v) for v in np.asarray(shard.data)[:, 0, 0]})
        if ep == 1:
            # Without EP, FSDP (if any) splits the expert dim over the fsdp group.
            assert len(held) == experts // (fsdp if fsdp > 1 and experts % fsdp == 0 else 1)
            continue
        owned = list(layout.experts_of(rank, experts))
        efsdp = config.efsdp_size
        if efsdp > 1 and config.dp_size > 1:
            position = layout.coordinates(rank)["efsdp"]
            per = len(owned) // efsdp
            owned = owned[position * per:(position + 1) * per]
        assert held == owned, (rank, held, owned)


def test_fsdp_moves_to_a_dimension_that_divides():
    config = DistributedConfig(fsdp_size=8)
    plans = resolve_parallel_plans(TinyQwen3MoeForCausalLM(), config)
    sharding = parameter_sharding("model.norm.weight", (12, 16), plans, DeviceLayout.from_config(config))
    assert sharding.spec == P(None, "efsdp")
    whole = parameter_sharding("model.norm.weight", (12,), plans, DeviceLayout.from_config(config))
    assert whole.spec == P(None) and not whole.fsdp


def test_tp_dimension_that_does_not_divide_names_the_fix():
    config = DistributedConfig(tp_size=8)
    plans = resolve_parallel_plans(TinyQwen3MoeForCausalLM(), config)
    with pytest.raises(ValueError, match=r"Cannot split `model.layers.0.self_attn.k_proj.weight` \[12, 32\] on dim 0"):
        parameter_sharding("model.layers.0.self_attn.k_proj.weight", (12, 32), plans, DeviceLayout.from_config(config))


def test_experts_that_do_not_divide_over_ep_raise_reference_text():
    config = DistributedConfig(fsdp_size=8, ep_size=8)
    plans = resolve_parallel_plans(TinyQwen3MoeForCausalLM(), config)
    with pytest.raises(ValueError, match="Cannot evenly shard 6 experts across 8 expert-parallel ranks."):
        parameter_sharding("model.layers.1.mlp.experts.down_proj", (6, 32, 16), plans, DeviceLayout.from_config(config))
