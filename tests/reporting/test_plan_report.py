"""`moe-jax plan`'s report keeps HF names and says which layers run scanned."""

from moe_jax import DistributedConfig
from moe_jax.causal_lm import Qwen3MoeForCausalLM
from moe_jax.reporting.plan_report import plan_report

from ..models.hf_reference import TINY_QWEN3_MOE


def test_report_lists_per_layer_hf_names_and_the_scanned_runs():
    config = DistributedConfig(tp_size=2, fsdp_size=4, ep_size=4)
    scanned = plan_report(Qwen3MoeForCausalLM(TINY_QWEN3_MOE, config, abstract=True, scan_layers=True))
    assert "model.layers.*.mlp.experts.gate_up_proj" in scanned and "layers 1-2" in scanned
    assert "layers: 0, 1-2 scanned (a scanned run stores each parameter as [layers, ...]" in scanned
    unrolled = plan_report(Qwen3MoeForCausalLM(TINY_QWEN3_MOE, config, abstract=True, scan_layers=False))
    assert "layers: unrolled (one compiled copy per layer)" in unrolled
