"""The sampler's and the trainer's log probabilities of sampled tokens agree when the sampler's routing is
replayed: `generate_batch(..., logprobs=True, return_routing=True)` against `sequence_logprobs(..., routing=)` on
the same layout, fp32, within 1e-5, for Qwen3-MoE (fsdp8/ep8, all_to_all) and DeepSeek-V3 (tp2/fsdp4/ep2,
all_reduce; all_reduce needs ep == tp)."""

import jax
import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.rl import rollout_batch
from moe_jax.training import sequence_logprobs

from ..models.hf_reference import TINY_DEEPSEEK_V3, TINY_QWEN3_MOE

FSDP8_EP8 = dict(fsdp_size=8, ep_size=8, ep_implementation="all_to_all")
TP2_FSDP4_EP2 = dict(tp_size=2, fsdp_size=4, ep_size=2, ep_implementation="all_reduce")
CASES = {
    "qwen3_moe_fsdp8_ep8": ("qwen3_moe", TINY_QWEN3_MOE, FSDP8_EP8),
    "deepseek_v3_tp2_fsdp4_ep2": ("deepseek_v3", TINY_DEEPSEEK_V3, TP2_FSDP4_EP2),
    # heavy: the other family on each layout
    "qwen3_moe_tp2_fsdp4_ep2": ("qwen3_moe", TINY_QWEN3_MOE, TP2_FSDP4_EP2),
    "deepseek_v3_fsdp8_ep8": ("deepseek_v3", TINY_DEEPSEEK_V3, FSDP8_EP8),
}
HEAVY = ("qwen3_moe_tp2_fsdp4_ep2", "deepseek_v3_fsdp8_ep8", "qwen3_moe_fsdp8_ep8")   # the suite: all_reduce


@pytest.mark.parametrize("case", [pytest.param(name, marks=pytest.mark.heavy) if name in HEAVY else name
                                  for name in CASES])
def test_replayed_train_step_logprobs_equal_the_samplers(case):
    model_type, config, layout = CASES[case]
    model = AutoModelForCausalLM.from_config({**config, "model_type": model_type}, DistributedConfig(**layout),
                                             devices=jax.devices()[:8])
    model.init_params(seed=0)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 100, int(length))] for length in rng.integers(4, 12, 8)]
    outputs = list(model.generate_batch(prompts, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=6,
                                        eos_token_id=-1, logprobs=True, return_routing=True, seed=3).values())
    batch = rollout_batch(outputs, np.zeros(len(outputs)), length=18)
    trained = np.asarray(sequence_logprobs(model, model.params, batch["input_ids"], routing=batch["routing"],
                                           attention_mask=batch["attention_mask"]))
    completion = batch["labels"][:, 1:] != -100                      # [B, S - 1]: the sampled tokens' predictions
    np.testing.assert_allclose(trained[completion], batch["old_logprobs"][:, :-1][completion], atol=1e-5, rtol=0)
