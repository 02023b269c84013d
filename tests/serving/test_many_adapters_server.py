"""A server over several LoRA adapters (`--lora-modules`): /v1/models lists the base and each adapter (its
`parent` the base, as vLLM's), a request's `model` picks the adapter its tokens come from, an unknown one is 404;
the flag's NAME=DIR pairs are checked before any model is built."""

from __future__ import annotations

import argparse

import jax
import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from moe_jax import AutoModelForCausalLM  # noqa: E402
from moe_jax.cli.adapter_flags import add_lora_modules_flags, add_use_flags, lora_modules  # noqa: E402
from moe_jax.lora import LoraConfig  # noqa: E402
from moe_jax.tokenization import load_checkpoint_tokenizer  # noqa: E402

from .live import NAME, SERVER_FLAGS, serving, write_checkpoint  # noqa: E402

PROMPT = [72, 105, 33, 10, 40, 41]
NEW_TOKENS = 4


def test_models_list_the_adapters_and_model_routes_requests(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, devices=jax.devices()[:1], progress=False)
    rng = np.random.default_rng(0)
    expected = {NAME: model.generate(np.array([PROMPT]), max_new_tokens=NEW_TOKENS)[0, len(PROMPT):].tolist()}
    dirs = {}
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    for name, config in (("sql", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=experts)),
                         ("chat", LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj", "gate_proj"]))):
        model.add_adapter(config)
        model.set_adapter_params({key: 0.5 * rng.standard_normal(a.shape) for key, a in model.adapter.items()})
        expected[name] = model.generate(np.array([PROMPT]), max_new_tokens=NEW_TOKENS)[0, len(PROMPT):].tolist()
        dirs[name] = model.save_adapter(tmp_path / name)
        model.delete_adapter()
    assert len({tuple(tokens) for tokens in expected.values()}) == 3
    model.load_adapters(dirs)
    tokenizer = load_checkpoint_tokenizer(checkpoint, instead="-")
    manager = model.init_continuous_batching(decode=tokenizer.decode, **SERVER_FLAGS)
    with serving(model, manager, tokenizer) as served:
        cards = served.client.models.list().data
        assert [card.id for card in cards] == [NAME, "sql", "chat"]
        assert [getattr(card, "parent", None) for card in cards] == [None, NAME, NAME]
        assert served.client.models.retrieve("chat").parent == NAME
        for name, tokens in expected.items():
            response = served.client.completions.create(model=name, prompt=PROMPT, max_tokens=NEW_TOKENS,
                                                        temperature=0)
            assert response.model == name
            assert response.choices[0].text == tokenizer.decode(tokens)
        with pytest.raises(openai.NotFoundError, match="`tiny-moe`, `sql`, `chat`"):
            served.client.completions.create(model="other", prompt=PROMPT, max_tokens=1)


def flags(*argv):
    parser = argparse.ArgumentParser()
    add_use_flags(parser, merge_help="-")
    add_lora_modules_flags(parser)
    return parser.parse_args(list(argv))


def test_lora_modules_pairs_are_checked(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path / "tiny"), devices=jax.devices()[:1],
                                                 progress=False)
    model.add_adapter(LoraConfig(r=2, target_modules=["q_proj"]))
    good = str(model.save_adapter(tmp_path / "a"))
    assert lora_modules(flags("--lora-modules", f"a={good}", f"b={good}"), NAME) == {"a": good, "b": good}
    assert lora_modules(flags(), NAME) is None
    for argv, message in ((("--lora-modules", good), "expected NAME=DIR"),
                          (("--lora-modules", f"a={good}", f"a={good}"), "given twice"),
                          (("--lora-modules", f"{NAME}={good}"), "the served model's name"),
                          (("--lora-modules", f"a={good}", f"b={good}", "--max-loras", "1"), "--max-loras 1"),
                          (("--max-loras", "2"), "needs --lora-modules"),
                          (("--lora-modules", f"a={good}", "--adapter", good), "one or the other"),
                          (("--lora-modules", f"a={tmp_path / 'missing'}"), "--lora-modules a=")):
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            lora_modules(flags(*argv), NAME)
