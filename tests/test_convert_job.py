"""`moe-jax convert` / scripts/convert.py: HF <-> orbax end to end, on chosen layouts, with clear errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from converters.orbax_params import read_orbax_config, restore_orbax_params, stored_shapes
from moe_jax import AutoModelForCausalLM
from moe_jax.cli import main
from tests.converters.tiny_checkpoints import read_checkpoint, same_bits
from tests.models.hf_reference import TINY_QWEN3_MOE

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {**TINY_QWEN3_MOE, "model_type": "qwen3_moe"}


def convert(*argv: str) -> int:
    return main(["convert", *argv, "--no-progress"])


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "tiny-qwen3-moe"
    model = AutoModelForCausalLM.from_config(CONFIG)
    model.init_params(seed=7)
    model.save_pretrained(directory, progress=False)
    return directory


def test_hf_to_orbax_to_hf_on_two_layouts_is_bit_identical(hf_checkpoint, tmp_path, capsys):
    assert convert("--from", "hf", "--to", "orbax", str(hf_checkpoint), str(tmp_path / "orbax"),
                   "--fsdp", "8", "--ep", "8") == 0
    out = capsys.readouterr().out
    assert "onto 8 cpu device(s) (tp=1 fsdp=8 ep=8 dp_replicate=1)" in out and "36 parameters" in out
    assert read_orbax_config(tmp_path / "orbax")["model_type"] == "qwen3_moe"

    assert convert("--from", "orbax", "--to", "hf", str(tmp_path / "orbax"), str(tmp_path / "hf"),
                   "--tp", "2", "--fsdp", "4", "--ep", "4") == 0
    assert "(tp=2 fsdp=4 ep=4 dp_replicate=1)" in capsys.readouterr().out
    original, round_trip = read_checkpoint(hf_checkpoint), read_checkpoint(tmp_path / "hf")
    assert sorted(round_trip) == sorted(original)
    for key in original:
        assert same_bits(round_trip[key], original[key]), key


def test_dtype_flag_casts_and_is_recorded_in_config(hf_checkpoint, tmp_path):
    assert convert("--from", "hf", "--to", "orbax", str(hf_checkpoint), str(tmp_path / "orbax"),
                   "--dtype", "bfloat16") == 0
    assert read_orbax_config(tmp_path / "orbax")["dtype"] == "bfloat16"
    assert convert("--from", "orbax", "--to", "hf", str(tmp_path / "orbax"), str(tmp_path / "hf"), "--fsdp", "2") == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    original, converted = read_checkpoint(hf_checkpoint), read_checkpoint(tmp_path / "hf")
    for key in original:
        assert same_bits(converted[key], original[key].astype(ml_dtypes.bfloat16)), key


def test_orbax_to_orbax_through_an_hsdp_layout_keeps_every_value(hf_checkpoint, tmp_path):
    assert convert("--from", "hf", "--to", "orbax", str(hf_checkpoint), str(tmp_path / "a"), "--tp", "2") == 0
    assert convert("--from", "orbax", "--to", "orbax", str(tmp_path / "a"), str(tmp_path / "b"),
                   "--dp-replicate", "2", "--fsdp", "2", "--tp", "2", "--ep", "2") == 0
    assert stored_shapes(tmp_path / "b" / "params") == stored_shapes(tmp_path / "a" / "params")

    original = AutoModelForCausalLM.from_pretrained(hf_checkpoint, progress=False).params
    for checkpoint in ("a", "b"):
        restored = restore_orbax_params(tmp_path / checkpoint, AutoModelForCausalLM.from_config(CONFIG))
        assert restored.keys() == original.keys()
        for name, array in restored.items():
            assert same_bits(np.asarray(array), np.asarray(original[name])), f"{checkpoint}: {name}"


def test_bad_requests_print_an_error_and_exit_2(hf_checkpoint, tmp_path, capsys):
    def error_of(*argv):
        assert convert(*argv) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("error: ")
        return captured.err

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("keep me")
    assert "Destination" in error_of("--from", "hf", "--to", "orbax", str(hf_checkpoint), str(tmp_path / "taken"))
    assert (tmp_path / "taken" / "notes.txt").read_text() == "keep me"

    assert "does not exist" in error_of("--from", "hf", "--to", "orbax", str(tmp_path / "nowhere"), str(tmp_path / "x"))
    (tmp_path / "no-config" / "params").mkdir(parents=True)
    assert "No config.json in" in error_of("--from", "orbax", "--to", "hf", str(tmp_path / "no-config"),
                                           str(tmp_path / "x"))

    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "model_type='llama' is not supported" in error_of("--from", "hf", "--to", "orbax", str(llama),
                                                             str(tmp_path / "x"))
    assert "model_type='llama' is not supported" in error_of("--from", "orbax", "--to", "hf", str(llama),
                                                             str(tmp_path / "x"))

    too_many = error_of("--from", "hf", "--to", "orbax", str(hf_checkpoint), str(tmp_path / "x"), "--fsdp", "16")
    assert "needs 16 devices but JAX started with 8 CPU device(s)" in too_many
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=16" in too_many
    assert "`ep_size` must divide" in error_of("--from", "hf", "--to", "orbax", str(hf_checkpoint),
                                               str(tmp_path / "x"), "--fsdp", "2", "--ep", "4")
    assert not (tmp_path / "x").exists()


def test_script_requests_virtual_cpu_devices_in_a_fresh_process(hf_checkpoint, tmp_path):
    environment = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    environment["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "convert.py"), "--from", "hf", "--to", "orbax",
         str(hf_checkpoint), str(tmp_path / "orbax"), "--tp", "2", "--fsdp", "2", "--ep", "2", "--no-progress"],
        capture_output=True, text=True, timeout=300, env=environment, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "onto 4 cpu device(s)" in result.stdout
    assert stored_shapes(tmp_path / "orbax" / "params")["model.embed_tokens.weight"] == (128, 32)


def test_conversions_carry_the_tokenizer_chat_template_and_generation_config_both_ways(hf_checkpoint, tmp_path,
                                                                                       capsys):
    """(was: HF -> orbax -> HF kept the weights and dropped the rest: `generate --prompt` found no tokenizer)"""
    from moe_jax.tokenization import BYTE_CHAT_TEMPLATE, load_checkpoint_tokenizer, write_byte_tokenizer

    source = tmp_path / "source"
    source.mkdir()
    for path in hf_checkpoint.iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    write_byte_tokenizer(source, chat_template=BYTE_CHAT_TEMPLATE)
    (source / "chat_template.jinja").write_text("{{ messages[0]['content'] }}\n")
    (source / "special_tokens_map.json").write_text('{"eos_token": "\\n"}')
    (source / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.7, "top_k": 5}\n')
    carried = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "generation_config.json"]
    assert convert("--from", "hf", "--to", "orbax", str(source), str(tmp_path / "orbax")) == 0
    assert f"carried {', '.join(carried)}" in capsys.readouterr().out
    assert convert("--from", "orbax", "--to", "hf", str(tmp_path / "orbax"), str(tmp_path / "hf")) == 0
    for name in carried:
        assert (tmp_path / "orbax" / name).read_bytes() == (source / name).read_bytes(), name
        assert (tmp_path / "hf" / name).read_bytes() == (source / name).read_bytes(), name
    tokenizer = load_checkpoint_tokenizer(tmp_path / "hf", instead="-")
    assert tokenizer.decode(tokenizer.encode("héllo")) == "héllo"
