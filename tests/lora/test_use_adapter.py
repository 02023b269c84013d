"""Using an adapter from the command line: `generate --adapter` (unmerged, and merged with --merge-adapter) gives
`model.generate`'s tokens with the adapter, `serve --adapter` answers with them, `convert --merge-adapter` writes a
merged HF checkpoint with the unmerged logits; a missing adapter is one error line."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM
from moe_jax.cli import main
from moe_jax.lora import LoraConfig
from moe_jax.tokenization import load_checkpoint_tokenizer

from ..models.hf_reference import LOGITS_ATOL

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from ..serving.live import serve_command, write_checkpoint  # noqa: E402

PROMPT_IDS = [72, 105, 33, 10]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """(checkpoint, adapter dir, greedy ids with the adapter, greedy ids without, logits with the adapter)."""
    root = tmp_path_factory.mktemp("use_adapter")
    checkpoint = write_checkpoint(root / "tiny")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, devices=jax.devices()[:1], progress=False)
    prompt = np.array([PROMPT_IDS])
    base = model.generate(prompt, max_new_tokens=NEW_TOKENS)[0, len(PROMPT_IDS):].tolist()
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    rng = np.random.default_rng(0)
    model.set_adapter_params({name: 0.5 * rng.standard_normal(array.shape) for name, array in model.adapter.items()})
    model.save_adapter(root / "adapter")
    adapted = model.generate(prompt, max_new_tokens=NEW_TOKENS)[0, len(PROMPT_IDS):].tolist()
    assert adapted != base
    return checkpoint, root / "adapter", adapted, np.asarray(model(prompt))


def generated_ids(output: str) -> list[int]:
    return [int(token) for token in output.strip().splitlines()[-1].split(",")][len(PROMPT_IDS):]


@pytest.mark.parametrize("merge", [False, True], ids=["unmerged", "merged"])
def test_generate_applies_the_adapter(adapted, merge, capsys):
    checkpoint, adapter, expected, _ = adapted
    argv = ["generate", "--model", str(checkpoint), "--adapter", str(adapter), "--prompt-ids",
            ",".join(map(str, PROMPT_IDS)), "--max-new-tokens", str(NEW_TOKENS)]
    assert main(argv + (["--merge-adapter"] if merge else [])) == 0
    captured = capsys.readouterr()
    assert generated_ids(captured.out) == expected
    assert f"adapter {adapter}" + (" merged" if merge else "") in captured.err


def test_convert_merges_the_adapter_into_an_hf_checkpoint(adapted, tmp_path):
    checkpoint, adapter, _, logits = adapted
    assert main(["convert", "--from", "hf", "--to", "hf", str(checkpoint), str(tmp_path / "merged"),
                 "--merge-adapter", str(adapter), "--no-progress"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", devices=jax.devices()[:1], progress=False)
    assert merged.adapter is None
    np.testing.assert_allclose(np.asarray(merged(np.array([PROMPT_IDS]))), logits, atol=LOGITS_ATOL, rtol=0)
    assert (tmp_path / "merged" / "tokenizer.json").exists()


def test_the_serve_command_answers_with_the_adapter(adapted):
    checkpoint, adapter, expected, _ = adapted
    with serve_command(checkpoint, "--adapter", str(adapter), "--max-slots", "2", "--page-size", "16",
                       "--max-model-len", "32", "--prefill-chunk", "16", "--no-warmup",
                       "--log-level", "warning") as (process, lines):
        started = lines[-1] if lines else ""
        assert started.startswith("serving tiny at http://127.0.0.1:"), "".join(lines)
        url = re.search(r"(http://\S+/v1)", started).group(1)
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        response = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=NEW_TOKENS, temperature=0)
        text = response.choices[0].text
    assert text == load_checkpoint_tokenizer(checkpoint, instead="-").decode(expected)


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt-ids", "1,2", "--adapter", "missing/"], r"--adapter missing/: missing/: no adapter_config"),
    (["generate", "--prompt-ids", "1,2", "--merge-adapter"], r"--merge-adapter needs --adapter DIR"),
    (["serve", "--adapter", "missing/"], r"--adapter missing/: missing/: no adapter_config.json"),
])
def test_a_missing_adapter_is_one_error_line(adapted, argv, message, capsys):
    checkpoint = adapted[0]
    assert main([argv[0], "--model", str(checkpoint), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and re.search(message, err), err
