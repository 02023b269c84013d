"""`moe-jax generate`: text through the checkpoint's tokenizer, streamed; bad requests get one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from moe_jax.cli import main
from tests.inference.hf_generation import FIXTURES, MODELS

WORDS = ["[UNK]"] + [f"w{i}" for i in range(127)]   # one word per id of the tiny vocabulary (128)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The qwen3_moe fixture with a word-level tokenizer (word `w{i}` is id i + 1)."""
    tokenizers = pytest.importorskip("tokenizers", reason="the word-level test tokenizer is built with tokenizers")
    directory = tmp_path_factory.mktemp("generate") / "qwen3_moe"
    shutil.copytree(MODELS / "qwen3_moe", directory)
    vocabulary = {word: i for i, word in enumerate(WORDS)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def test_generate_prints_the_prompt_and_the_greedy_continuation(checkpoint, capsys):
    expected = np.load(FIXTURES / "qwen3_moe.npz")
    prompt_ids = expected["input_ids"][0]          # row 0 has no padding
    prompt = " ".join(WORDS[i] for i in prompt_ids)
    # --scan-layers true: the fixture's 3 layers run as one scan (auto unrolls them, as the next test runs them)
    assert main(["generate", "--model", str(checkpoint), "--prompt", prompt, "--max-new-tokens", "20",
                 "--tp", "2", "--ep", "2", "--fsdp", "4", "--scan-layers", "true"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == " ".join(WORDS[i] for i in expected["greedy"][0])
    assert "prefill 7 tokens" in err and "decode 20 tokens in 20 steps" in err and "tokens/s" in err


def test_scan_layers_flag_sets_the_model_option_of_every_decoding_command():
    from moe_jax.cli import build_parser
    from moe_jax.cli.layout_flags import scan_layers_from_flags

    parser = build_parser()
    for command in (["generate", "--prompt-ids", "1"], ["serve"]):
        for flag, option in (("auto", False), ("true", True), ("false", False)):   # decoding: auto is unrolled
            args = parser.parse_args([*command, "--model", "m", "--scan-layers", flag])
            assert scan_layers_from_flags(args, decoding=True) == option
    assert scan_layers_from_flags(parser.parse_args(["serve", "--model", "m"]), decoding=True) is False
    train = parser.parse_args(["train", "--scan-layers", "auto"])
    assert scan_layers_from_flags(train) == "auto"     # training keeps the model's rule (scan from 16 layers)


def test_prompts_given_as_token_ids_need_no_tokenizer(tmp_path, capsys):
    """`--prompt-ids` and a `--prompt-file` of id lines on the fixture checkpoint, which has no tokenizer
    (was: `error: ... has no tokenizer`): the prompt and the new ids are printed as ids, the batch of
    three left-padded like the fixture's prompts."""
    expected = np.load(FIXTURES / "qwen3_moe.npz")
    prompts = [ids[mask == 1].tolist() for ids, mask in zip(expected["input_ids"], expected["attention_mask"])]
    sequences = [prompt + row[7:].tolist() for prompt, row in zip(prompts, expected["greedy"])]
    layout = ["--tp", "2", "--ep", "2", "--fsdp", "4", "--max-new-tokens", "20"]
    as_text = [",".join(str(token) for token in ids) for ids in prompts]
    assert main(["generate", "--model", str(MODELS / "qwen3_moe"), "--prompt-ids", as_text[0], *layout]) == 0
    assert capsys.readouterr().out.strip() == ",".join(str(token) for token in sequences[0])
    (tmp_path / "prompts.txt").write_text("\n".join(as_text[:1] + [" 84, 117,65 , 78", as_text[2]]) + "\n")
    assert main(["generate", "--model", str(MODELS / "qwen3_moe"), "--prompt-file", str(tmp_path / "prompts.txt"),
                 *layout]) == 0
    assert capsys.readouterr().out.splitlines() == [",".join(str(token) for token in ids) for ids in sequences]


BAD_REQUESTS = {
    "missing checkpoint": (lambda ckpt: ["--model", str(ckpt.parent / "nope"), "--prompt", "w1"],
                           "not a checkpoint directory"),
    "no tokenizer": (lambda ckpt: ["--model", str(MODELS / "qwen3_moe"), "--prompt", "w1"],
                     "has no tokenizer (none of tokenizer.json, tokenizer_config.json, tokenizer.model, "
                     "vocab.json); give the prompt as token ids with --prompt-ids 1,2,3"),
    "ids that are not ids": (lambda ckpt: ["--model", str(ckpt), "--prompt-ids", "1,w2"],
                             "--prompt-ids '1,w2' is not token ids: give comma-separated integers"),
    "an id outside the vocabulary": (lambda ckpt: ["--model", str(ckpt), "--prompt-ids", "1,128"],
                                     "token id 128 is outside the model's vocabulary [0, 128)"),
    "prompt too long": (lambda ckpt: ["--model", str(ckpt), "--prompt", " ".join(["w1"] * 250),
                                      "--max-new-tokens", "10"], "more than the model's 256 positions"),
    "unknown ep implementation": (lambda ckpt: ["--model", str(ckpt), "--prompt", "w1", "--ep", "2",
                                                "--fsdp", "2", "--ep-implementation", "nope"],
                                  "names no registered implementation"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_a_bad_request_is_one_error_line(checkpoint, capsys, case):
    arguments, message = BAD_REQUESTS[case]
    assert main(["generate", *arguments(checkpoint)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ")
    assert message in err


def test_the_summary_line_says_the_weights_are_quantised(capsys):
    assert main(["generate", "--model", str(MODELS / "qwen3_moe"), "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                 "--quantize", "int8"]) == 0
    err = capsys.readouterr().err
    assert "up to 2 new tokens, int8 weight-only quantised (experts)" in err
