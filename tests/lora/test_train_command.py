"""`moe-jax train --lora-rank ...` as users run it: 5 steps on fsdp8/ep8, the adapter exported in PEFT's format
(PeftModel loads it and gives our logits), the base checkpoint's bytes unchanged, the merged HF export equal to
the unmerged adapter; the checkpoint holds the adapter and its optimizer state only."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.cli import main

from ..models.hf_reference import LOGITS_ATOL
from ..training.hf_training import CHECKPOINT

LORA_FLAGS = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", "q_proj,v_proj",
              "--lora-target-parameters", "mlp.experts.gate_up_proj,mlp.experts.down_proj"]
IDS = np.random.default_rng(0).integers(3, 128, (8, 10)).astype(np.int32)


def digests(directory) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


def train_argv(base, tmp_path, steps: int, *extra) -> list[str]:
    return ["train", "--model", str(base), "--fsdp", "8", "--ep", "8", "--steps", str(steps), "--batch-size", "8",
            "--seq-len", "16", "--lr", "1e-2", "--no-progress", "--checkpoint-dir", str(tmp_path / "ckpt"),
            *LORA_FLAGS, *extra]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 5-step LoRA run on a copy of the fixture checkpoint: (base dir, its digests before, the adapter dir, the
    merged export dir, the JSONL path, the checkpoint dir)."""
    tmp_path = tmp_path_factory.mktemp("lora_run")
    base = tmp_path / "base"
    shutil.copytree(CHECKPOINT, base)
    before = digests(base)
    argv = train_argv(base, tmp_path, 5, "--save-every", "5", "--export-adapter", str(tmp_path / "adapter"),
                      "--export-hf", str(tmp_path / "merged"), "--metrics-jsonl", str(tmp_path / "metrics.jsonl"))
    assert main(argv) == 0
    return base, before, tmp_path / "adapter", tmp_path / "merged", tmp_path / "metrics.jsonl", tmp_path / "ckpt"


def ours(path, adapter=None):
    model = AutoModelForCausalLM.from_pretrained(path, DistributedConfig(fsdp_size=8, ep_size=8), progress=False)
    if adapter is not None:
        model.load_adapter(adapter)
    return model, np.asarray(model(IDS))


def test_the_run_trains_the_adapter_leaves_the_base_and_merges_exactly(lora_run):
    base, before, adapter, merged, jsonl, _ = lora_run
    assert digests(base) == before
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2, 3, 4, 5]
    assert records[-1]["loss"] < records[0]["loss"]
    model, unmerged = ours(base, adapter)
    _, plain = ours(base)
    assert np.abs(unmerged - plain).max() > 1e-3   # the adapter learned something
    np.testing.assert_allclose(ours(merged)[1], unmerged, atol=LOGITS_ATOL, rtol=0)
    assert (merged / "tokenizer.json").exists() == (base / "tokenizer.json").exists()


@pytest.mark.reference
@pytest.mark.peft
def test_peft_loads_the_exported_adapter_with_our_logits(lora_run):
    import torch
    import transformers
    from peft import PeftModel

    base, _, adapter, _, _, _ = lora_run
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft = PeftModel.from_pretrained(hf, str(adapter)).eval()
    with torch.no_grad():
        expected = peft(input_ids=torch.as_tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(ours(base, adapter)[1], expected, atol=LOGITS_ATOL, rtol=0)


def test_the_checkpoint_holds_the_adapter_and_its_optimizer_state_only(lora_run):
    import orbax.checkpoint as ocp

    _, _, _, _, _, checkpoint_dir = lora_run
    manager = ocp.CheckpointManager(checkpoint_dir)
    record = manager.restore(5, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"]
    manager.close()
    assert record["adapter"]["r"] == 4 and record["trainable"]
    assert all(".lora_A" in name or ".lora_B" in name for name in record["parameters"])
    assert set(record["parameters"]) == set(record["trainable"])
