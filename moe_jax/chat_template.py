"""A checkpoint's chat template rendered without Transformers: the same sandboxed Jinja environment, globals and
inputs that Transformers' `apply_chat_template` gives a template, so `moe-jax serve`'s chat endpoint needs only
`tokenizers` and `jinja2`.

    template = read_chat_template("ckpt/")                       # None when the checkpoint has none
    text = render_chat_template(template, messages, special_tokens("ckpt/"))
    text = render_chat_template(template, messages, tokens, tools=[{"type": "function", "function": {...}}])

Chat templates come from the hub and are untrusted code: they run in Jinja's immutable sandbox, and everything
they see is plain JSON data.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

# Where a saved tokenizer keeps its template: its own file (Transformers >= 4.43 writes it), else a field.
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# The special tokens templates read by name (`{{ bos_token }}`).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def read_chat_template(directory) -> str | None:
    """The checkpoint's default chat template: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (a string, or a list of named templates: the one named "default"); None without one."""
    directory = Path(directory)
    if (directory / TEMPLATE_FILE).is_file():
        return (directory / TEMPLATE_FILE).read_text(encoding="utf-8")
    template = _tokenizer_config(directory).get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def special_tokens(directory) -> dict[str, str]:
    """bos_token, eos_token, ... as tokenizer_config.json names them (strings or {"content": ...} entries)."""
    config = _tokenizer_config(Path(directory))
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def render_chat_template(template: str, messages: list[dict], tokens: dict[str, str] | None = None, *,
                         add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """The prompt text `template` makes of `messages` ([{"role", "content"}], an assistant's with "tool_calls",
    a tool's with "tool_call_id"), ending with the assistant's turn when `add_generation_prompt`; `tools`: the
    function tools ([{"type": "function", "function": {"name", "description", "parameters"}}]), None as
    Transformers passes when there are none. A template's own `raise_exception` raises `jinja2.TemplateError`."""
    compiled = _compile(template)
    return compiled.render(messages=_plain(messages), add_generation_prompt=add_generation_prompt,
                           tools=_plain(tools), **_plain(dict(tokens or {})))


def _tokenizer_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    return config if isinstance(config, dict) else {}


def _plain(value):
    """`value` rebuilt from plain JSON types: templates must not reach methods of richer objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=8)
def _compile(template: str):
    try:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError('chat templates need jinja2: pip install "moe_jax[serve]" (or jinja2)') from None

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` (marks the assistant's tokens for training masks): its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own filter escapes HTML characters, which no prompt wants.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(template)
