"""Several LoRA adapters in one engine (`model.load_adapters`): requests naming different adapters, and none,
share steps, and each request's greedy tokens are those of its adapter served alone; adapters of other ranks and
targets (the fused experts' included, on every layout: tokens dispatched over ep with their adapter index, and
redundant expert slots) stack; what the set cannot serve is refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM, EPImplementation, EPImplementationInterface
from moe_jax.distributed.config import DistributedConfig
from moe_jax.distributed.eplb import placement_from_slots
from moe_jax.lora import LoraConfig
from moe_jax.ops.lora import ADAPTER_INDEX

from ..heavy import representative
from ..inference.hf_generation import MODELS
from ..inference.test_manager import collect, with_handlers

FLAGS = dict(max_slots=4, page_size=4, max_model_len=64, prefill_chunk=4)
NEW_TOKENS = 5
# Both adapt the experts (wide: both fused weights, narrow: one) beside attention, at other ranks and scalings.
ADAPTERS = {"wide": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
            "narrow": LoraConfig(r=2, lora_alpha=6, target_modules=["k_proj", "v_proj", "q_proj"], use_rslora=True,
                                 target_parameters=["mlp.experts.down_proj"])}


# (distributed config, devices, scan_layers): layers one by one, a scanned run (the index broadcast over its
# layers), tensor / fully sharded parallel (the factors split with their weights, the experts' over tp), and expert
# parallel (each token's adapter index dispatched with it: all_to_all, and all_reduce where ep = tp).
LAYOUTS = {"one-device": (None, 1, False), "scanned": (None, 1, True),
           "tp2-fsdp2": (DistributedConfig(tp_size=2, fsdp_size=2), 4, True),
           "fsdp2-ep2": (DistributedConfig(fsdp_size=2, ep_size=2), 2, True),
           "tp2-ep2": (DistributedConfig(tp_size=2, ep_size=2), 2, True)}


def load(layout: str = "one-device"):
    config, devices, scan = LAYOUTS[layout]
    return AutoModelForCausalLM.from_pretrained(MODELS / "qwen3_moe", *([config] if config else []),
                                                devices=jax.devices()[:devices], progress=False, scan_layers=scan)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("many_adapters")
    model = load()
    rng = np.random.default_rng(0)
    dirs = {}
    for name, config in ADAPTERS.items():
        model.add_adapter(config)
        model.set_adapter_params({key: 0.5 * rng.standard_normal(array.shape) for key, array in model.adapter.items()})
        dirs[name] = model.save_adapter(root / name)
        model.delete_adapter()
    return dirs


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    shared = rng.integers(3, 100, 9).tolist()   # two full pages: a prefix the cache could share across adapters
    return [shared if i % 4 == 0 else rng.integers(3, 100, int(rng.integers(3, 11))).tolist() for i in range(12)]


def served(model, requests, **engine) -> list[list[int]]:
    with model.init_continuous_batching(**FLAGS, **engine) as manager:
        add = with_handlers(manager)
        ids = [add(prompt, max_new_tokens=NEW_TOKENS, **({} if name is None else {"adapter": name}))
               for prompt, name in requests]
        outputs = collect(manager, ids, timeout=600)
    return [outputs[request_id][-1].generated_tokens for request_id in ids]


# Heavy: the suite's engine mixing runs on fsdp2/ep2 below (scanned, expert adapters over ep).
@pytest.mark.parametrize("layout", representative(LAYOUTS, []))
def test_mixed_adapters_in_one_engine_equal_each_adapter_alone(adapter_dirs, layout):
    names = [None, "wide", "narrow"]
    requests = [(prompt, names[i % 3]) for i, prompt in enumerate(prompts())]
    alone = {}
    model = load(layout)
    alone[None] = served(model, [(p, None) for p, n in requests if n is None])
    for name in ("wide", "narrow"):
        model.load_adapter(adapter_dirs[name])
        alone[name] = served(model, [(p, None) for p, n in requests if n == name])
        model.delete_adapter()
    model.load_adapters(adapter_dirs)
    assert model.adapter_names == ("wide", "narrow")
    mixed = served(model, requests)
    expected = [alone[name].pop(0) for _, name in requests]
    assert mixed == expected
    # the adapters matter: the shared prompt (rows 0, 4, 8: base, wide, narrow) answers three ways
    assert len({tuple(mixed[0]), tuple(mixed[4]), tuple(mixed[8])}) == 3


# (distributed config, redundant expert slots): tokens dispatched by all_to_all (alone over ep, and beside tp),
# by all_reduce (ep = tp: every rank sees the batch), and redundant slots under a placement that moves every expert.
EP_LAYOUTS = {"fsdp8-ep8": (dict(fsdp_size=8, ep_size=8), 0),
              "tp2-fsdp4-ep2-all_reduce": (dict(tp_size=2, fsdp_size=4, ep_size=2, ep_implementation="all_reduce"),
                                           0),
              "tp2-fsdp4-ep4": (dict(tp_size=2, fsdp_size=4, ep_size=4), 0),
              "fsdp8-ep8-redundant8": (dict(fsdp_size=8, ep_size=8), 8)}


def shuffled_placement(model, seed: int = 0):
    """Each sparse layer's E + R slots holding the experts in a random order (not the identity placement's)."""
    experts, rng = model.config.num_experts, np.random.default_rng(seed)
    slots = np.arange(experts + model.num_redundant_experts) % experts
    return placement_from_slots(np.stack([rng.permutation(slots) for _ in range(model.num_sparse_layers)]), experts)


# The suite: all_to_all with redundant slots (all_reduce's rows: tests/distributed/test_expert_parallel.py).
@pytest.mark.parametrize("layout", representative(EP_LAYOUTS, ["fsdp8-ep8-redundant8"]))
def test_expert_adapters_over_ep_give_each_row_its_adapter_s_logits(adapter_dirs, layout):
    """Rows of the base, wide and narrow in one batch: each row's logits are those of its adapter loaded alone."""
    config, redundant = EP_LAYOUTS[layout]
    model = AutoModelForCausalLM.from_pretrained(MODELS / "qwen3_moe", DistributedConfig(**config), progress=False,
                                                 num_redundant_experts=redundant)
    placement = model.set_expert_placement(shuffled_placement(model)) if redundant else None
    ids = np.random.default_rng(3).integers(3, 100, (8, 6)).astype(np.int32)
    assert_each_row_takes_its_adapter(model, adapter_dirs, ids, placement, matters=0.1)
    factor = model.adapter[next(name for name in model.adapter if "experts.gate_up_proj.lora_A" in name)]
    assert factor.addressable_shards[0].data.shape[1] == model.config.num_experts // config["ep_size"]  # not gathered


def assert_each_row_takes_its_adapter(model, dirs, ids, placement=None, *, matters: float):
    """Rows of the base, wide and narrow (in turn) in one batch of the model holding both (`load_adapters`, left
    loaded): each row's logits are those of its adapter loaded alone (1e-5), and the three differ by `matters`."""
    index = np.repeat(np.arange(ids.shape[0])[:, None] % 3, ids.shape[1], axis=1).astype(np.int32)

    def logits(adapter=None):
        return np.asarray(model.apply(model.params, ids, adapter=adapter, expert_placement=placement).logits)

    alone = [logits()]
    for name in ("wide", "narrow"):
        model.load_adapter(dirs[name])
        alone.append(logits(model.adapter))
        model.delete_adapter()
    model.load_adapters(dirs)
    mixed = logits({**model.adapter, ADAPTER_INDEX: index})
    for row in range(ids.shape[0]):
        np.testing.assert_allclose(mixed[row], alone[row % 3][row], atol=1e-5, rtol=0, err_msg=f"row {row}")
    assert min(np.abs(alone[i] - alone[j]).max() for i, j in ((0, 1), (0, 2), (1, 2))) > matters


def test_mixed_expert_adapters_over_ep_serve_each_request_its_adapter_s_tokens(adapter_dirs):
    """fsdp2/ep2 (all_to_all) serving the base, wide and narrow at once: each request's greedy tokens are those of
    its adapter merged into the weights, served alone (one engine, its weights swapped between adapters; the
    heavy grid above serves each adapter unmerged in an engine of its own)."""
    model = load("fsdp2-ep2")
    names = [None, "wide", "narrow"]
    requests = [(prompt, names[i % 3]) for i, prompt in enumerate(prompts()[:6])]
    weights = {None: model.params}
    for name in ("wide", "narrow"):
        model.load_adapter(adapter_dirs[name])
        weights[name] = model.merged_params()
        model.delete_adapter()
    alone = {}
    with model.init_continuous_batching(**FLAGS) as manager:
        add = with_handlers(manager)
        for name, params in weights.items():
            manager.update_parameters(params)   # swapped in before the requests added next take a step
            ids = [add(prompt, max_new_tokens=NEW_TOKENS) for prompt, adapter in requests if adapter == name]
            outputs = collect(manager, ids, timeout=600)
            alone[name] = [outputs[request_id][-1].generated_tokens for request_id in ids]
    model.load_adapters(adapter_dirs)
    mixed = served(model, requests)
    assert mixed == [alone[name].pop(0) for _, name in requests]
    assert len({tuple(mixed[0]), tuple(mixed[1]), tuple(mixed[2])}) == 3


class UntaggedEP(EPImplementation):
    """Gathers the group's rows and runs its own experts on them: it takes no `adapter_index`."""

    def __call__(self, hidden_states, top_k_index, top_k_weights, *, experts_forward):
        axes, local = self.groups.ep_axes, self.num_local_experts
        rows, index, weights = (jax.lax.all_gather(a, axes, tiled=True)
                                for a in (hidden_states, top_k_index, top_k_weights))
        mine = index // local == self.ep_rank()
        out = experts_forward(rows, jnp.where(mine, index % local, local), jnp.where(mine, weights, 0.0))
        return jax.lax.psum_scatter(out, axes, tiled=True)


def test_unknown_adapter_and_expert_adapters_are_refused(adapter_dirs, tmp_path):
    model = load()
    model.load_adapters({"wide": adapter_dirs["wide"]})
    manager = model.init_continuous_batching(**FLAGS)
    with pytest.raises(ValueError, match="adapter 'other' is not loaded"):
        manager.add_request([5, 6, 7], adapter="other")
    with pytest.raises(ValueError, match="several adapters"):
        model.merge_adapter()
    EPImplementationInterface.register("untagged_example", UntaggedEP)
    try:
        untagged = AutoModelForCausalLM.from_pretrained(
            MODELS / "qwen3_moe", DistributedConfig(ep_size=2, fsdp_size=2, ep_implementation="untagged_example"),
            devices=jax.devices()[:2], progress=False)
        with pytest.raises(ValueError, match="adapter 'wide' adapts the fused expert weights .* not UntaggedEP"):
            untagged.load_adapters({"wide": adapter_dirs["wide"]})
        untagged.load_adapter(adapter_dirs["wide"])   # one adapter needs no index: any EP implementation serves it
    finally:
        del EPImplementationInterface._global_mapping["untagged_example"]


# heavy: ngram drafts and mixed adapters each have their suite test
@pytest.mark.heavy
def test_mixed_adapters_with_ngram_drafts_equal_plain_decoding(adapter_dirs):
    """Verification steps (and mixed steps that verify) carry each row's adapter to every drafted position."""
    names = [None, "wide", "narrow"]
    rng = np.random.default_rng(2)   # prompts of few distinct ids: generated ids recur in the context, and draft
    requests = [(rng.integers(3, 12, 14).tolist(), names[i % 3]) for i in range(6)]
    model = load("scanned")
    model.load_adapters(adapter_dirs)
    drafting = dict(speculative="ngram", num_speculative_tokens=2, ngram_min=1, ngram_max=2)
    assert served(model, requests, **drafting) == served(model, requests)


# Families whose experts differ from Qwen3-MoE's SwiGLU: gpt-oss (biased, clamped, [E, in, out] read transposed),
# Llama 4 ([E, in, out] read as [E, out, in]: the rows meet B first) and DeepSeek-V3 with its FP8 weights kept.
OTHER_EXPERTS = {"gpt_oss": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                 "llama4_text": ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"],
                 "deepseek_v3_kept_fp8": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


def other_family(name: str, tmp_path):
    if name != "deepseek_v3_kept_fp8":
        return AutoModelForCausalLM.from_pretrained(MODELS / name, devices=jax.devices()[:1], progress=False)
    from tests.converters.fp8_checkpoints import write_fp8_checkpoint

    directory = tmp_path / "deepseek_v3_fp8"
    write_fp8_checkpoint(MODELS / "deepseek_v3", directory, (8, 8))
    return AutoModelForCausalLM.from_pretrained(directory, devices=jax.devices()[:1], progress=False,
                                                dequantize=False)


@pytest.mark.parametrize("family", representative(OTHER_EXPERTS, ["gpt_oss"]))
def test_several_adapters_on_other_families_experts_give_each_row_its_adapter_s_logits(family, tmp_path):
    model = other_family(family, tmp_path)
    rng = np.random.default_rng(0)
    dirs = {}
    for name, (rank, down_only) in {"wide": (4, False), "narrow": (2, True)}.items():
        experts = OTHER_EXPERTS[family][1:] if down_only else OTHER_EXPERTS[family]
        model.add_adapter(LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["o_proj"],
                                     target_parameters=experts))
        model.set_adapter_params({key: 0.5 * rng.standard_normal(array.shape) for key, array in model.adapter.items()})
        dirs[name] = model.save_adapter(tmp_path / name)
        model.delete_adapter()
    assert_each_row_takes_its_adapter(model, dirs, rng.integers(3, 60, (6, 6)).astype(np.int32), matters=0.05)
