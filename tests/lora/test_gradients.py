"""The adapter's gradients equal PEFT's (torch autograd) for one batch: every factor of the attention projections
and of the fused experts, on one device and on tp2/fsdp2/ep4, within 1e-5 of each tensor's largest gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.lora.layout import factor_names
from moe_jax.lora.peft_files import peft_key, to_peft

from .test_peft_files import build, layout_id

pytestmark = [pytest.mark.reference, pytest.mark.peft]


@pytest.fixture(scope="module")
def peft_gradients(tmp_path_factory):
    """(base state, the saved adapter, the batch, PEFT's gradient of each factor by file key)."""
    import torch

    from .peft_reference import input_ids, peft_model

    state, model = peft_model("qwen3_moe")
    directory = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(str(directory))
    ids = input_ids()
    model.zero_grad()
    labels = torch.as_tensor(ids).long()
    model(input_ids=labels, labels=labels).loss.backward()
    grads = {name.replace(".default.", "."): parameter.grad.numpy() for name, parameter in model.named_parameters()
             if "lora_" in name}
    return state, directory, ids, grads


@pytest.mark.parametrize("layout", [None, dict(tp_size=2, fsdp_size=2, ep_size=4)], ids=layout_id)
def test_adapter_gradients_equal_peft_s(peft_gradients, layout):
    from .peft_reference import TINY_CONFIGS

    state, directory, ids, expected = peft_gradients
    model = build("qwen3_moe", TINY_CONFIGS["qwen3_moe"], layout, state)
    model.load_adapter(directory)
    tokens = jnp.asarray(ids)

    def loss(adapter):   # HF's loss with labels: the mean cross entropy of the shifted tokens
        logits = model.apply(model.params, tokens, inference=False, adapter=adapter).logits[:, :-1]
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1))

    grads = model.adapter_layout.per_layer(jax.jit(jax.grad(loss))(model.adapter))
    ours = {}
    for target in model.adapter_layout.targets:
        a, b = to_peft(target, *(np.asarray(grads[name]) for name in factor_names(target)))
        ours[peft_key(target, "A")], ours[peft_key(target, "B")] = a, b
    assert ours.keys() == expected.keys()
    for key, value in expected.items():
        scale = np.abs(value).max()
        assert scale > 0, key
        np.testing.assert_allclose(ours[key], value, atol=1e-5 * scale, rtol=0, err_msg=key)
