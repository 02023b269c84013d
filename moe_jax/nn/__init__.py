"""Dense layers as pure functions over HF-named parameter dicts (math only: no mesh, no sharding).

Import from the modules, e.g. `from moe_jax.nn.attention import attention`; they are not re-exported here
because several functions share their module's name (`linear`, `mlp`, `attention`), and re-exporting would
shadow the modules.

    linear.py       linear(params, x)                         torch.nn.Linear, weight [out, in]
    embedding.py    embed(params, ids, padding_idx=None)      torch.nn.Embedding
    norms.py        rms_norm(params, x, eps)                  Qwen3-MoE / Qwen2-MoE / OLMoE / Mixtral RMSNorm
    activations.py  ACTIVATIONS, get_activation(name)         HF ACT2FN (parameter-free entries)
    mlp.py          mlp(params, x, act)                       gated dense MLP (gate/up/down_proj)
    rotary.py       rope_parameters_from_config, rope_inverse_frequencies, rotary_cos_sin, apply_rotary
    attention.py    attention, project_qkv, attend, visibility_mask
"""
