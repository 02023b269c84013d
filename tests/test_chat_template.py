"""Chat templates rendered without Transformers: the text equals what Transformers' `apply_chat_template` renders,
templates cannot leave the sandbox, and the tokenizer-only path applies them."""

from __future__ import annotations

import json
import sys

import pytest

from moe_jax.chat_template import read_chat_template, render_chat_template, special_tokens
from moe_jax.tokenization import BYTE_CHAT_TEMPLATE, load_checkpoint_tokenizer, write_byte_tokenizer

pytest.importorskip("jinja2")

# What hub templates use: trimmed blocks, a namespace, loop controls, tojson, raise_exception, special tokens.
RICH_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% continue %}{% endif %}\n"
    "  {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}\n"
    "<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if ns.system %}[system: {{ ns.system | tojson }}]{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "be \"brief\" <ok>"}, {"role": "user", "content": " hi wörld "},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}


def test_rendering_equals_hand_written_text():
    text = render_chat_template(RICH_TEMPLATE, MESSAGES, TOKENS)
    assert text == ("<s><|user|>hi wörld</s>\n<|assistant|>hello</s>\n<|user|>again</s>\n"
                    '[system: "be \\"brief\\" <ok>"]<|assistant|>')
    assert not render_chat_template(RICH_TEMPLATE, MESSAGES, TOKENS, add_generation_prompt=False).endswith(
        "<|assistant|>")


def test_a_template_raising_names_its_message():
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
        render_chat_template(RICH_TEMPLATE, [{"role": "tool", "content": "x"}], TOKENS)


def test_templates_cannot_reach_python_internals():
    import jinja2

    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template(escape, MESSAGES, TOKENS)
    with pytest.raises(jinja2.exceptions.SecurityError):   # the sandbox is immutable: no mutating the inputs
        render_chat_template("{{ messages.append(1) }}", MESSAGES, TOKENS)


def test_the_template_is_read_from_its_file_or_the_config(tmp_path):
    assert read_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
        "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}))
    assert read_chat_template(tmp_path) == "D"
    assert special_tokens(tmp_path) == {"bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "chat_template.jinja").write_text("F")
    assert read_chat_template(tmp_path) == "F"


def test_without_transformers_the_tokenizer_applies_the_chat_template(tmp_path, monkeypatch):
    """`moe-jax serve`'s chat path on the `serve` extra alone (tokenizers + jinja2)."""
    pytest.importorskip("tokenizers")
    write_byte_tokenizer(tmp_path, chat_template=BYTE_CHAT_TEMPLATE)
    monkeypatch.setitem(sys.modules, "transformers", None)   # as if transformers were not installed
    tokenizer = load_checkpoint_tokenizer(tmp_path, instead="-")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hé"}])
    assert ids == list("<user>hé\n<assistant>".encode())


@pytest.mark.reference
def test_rendering_equals_transformers(tmp_path):
    """The same text as Transformers' own `apply_chat_template` for the same template and tokens."""
    from transformers import AutoTokenizer

    write_byte_tokenizer(tmp_path, chat_template=RICH_TEMPLATE)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | TOKENS))
    reference = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for add in (True, False):
        expected = reference.apply_chat_template(MESSAGES, add_generation_prompt=add, tokenize=False)
        assert render_chat_template(read_chat_template(tmp_path), MESSAGES, special_tokens(tmp_path),
                                    add_generation_prompt=add) == expected
