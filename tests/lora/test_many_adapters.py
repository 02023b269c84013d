"""Several LoRA adapters in one engine (`model.load_adapters`): requests naming different adapters, and none,
share steps, and each request's greedy tokens are those of its adapter served alone; adapters of other ranks and
targets (the fused experts' included) stack; what the set cannot serve is refused by name."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM
from moe_jax.distributed.config import DistributedConfig
from moe_jax.lora import LoraConfig

from ..heavy import representative
from ..inference.hf_generation import MODELS
from ..inference.test_manager import collect, with_handlers

FLAGS = dict(max_slots=4, page_size=4, max_model_len=64, prefill_chunk=4)
NEW_TOKENS = 5
ADAPTERS = {"wide": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
            "narrow": LoraConfig(r=2, lora_alpha=6, target_modules=["k_proj", "v_proj", "q_proj"], use_rslora=True)}


# (distributed config, devices, scan_layers): layers one by one, a scanned run (the index broadcast over its
# layers), and tensor / fully sharded parallel (the factors split with their weights, the experts' over tp).
LAYOUTS = {"one-device": (None, 1, False), "scanned": (None, 1, True),
           "tp2-fsdp2": (DistributedConfig(tp_size=2, fsdp_size=2), 4, True)}


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


@pytest.mark.parametrize("layout", representative(LAYOUTS, ["scanned"]))
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


def test_unknown_adapter_and_expert_adapters_are_refused(adapter_dirs, tmp_path):
    model = load()
    model.load_adapters({"wide": adapter_dirs["wide"]})
    manager = model.init_continuous_batching(**FLAGS)
    with pytest.raises(ValueError, match="adapter 'other' is not loaded"):
        manager.add_request([5, 6, 7], adapter="other")
    with pytest.raises(ValueError, match="several adapters"):
        model.merge_adapter()
    dispatched = AutoModelForCausalLM.from_pretrained(MODELS / "qwen3_moe", DistributedConfig(ep_size=2, fsdp_size=2),
                                                      devices=jax.devices()[:2], progress=False)
    with pytest.raises(ValueError, match="adapter 'wide' adapts the fused expert weights .* dispatched over ep"):
        dispatched.load_adapters({"narrow": adapter_dirs["narrow"], "wide": adapter_dirs["wide"]})
    dispatched.load_adapters({"narrow": adapter_dirs["narrow"]})   # dense targets: any layout


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
