"""The work both sides of the multi-process test do: the 2-process job (worker.py) and the one-process run
in the test, with the same inputs, so their results can be compared."""

from __future__ import annotations

import numpy as np

from moe_jax.distributed.host_arrays import to_host
from moe_jax.training import TrainLoop
from tests.inference.hf_generation import NEW_TOKENS
from tests.training.conftest import FixtureBatches
from tests.training.hf_training import CHECKPOINT

FORWARD_LAYOUTS = {
    "tp2_fsdp4_ep4": dict(tp_size=2, fsdp_size=4, ep_size=4),
    "fsdp8_ep8": dict(fsdp_size=8, ep_size=8),
}
TRAIN_LAYOUT = dict(tp_size=2, fsdp_size=4, ep_size=4)
# The PyTorch fixture's inputs: the one-process programs are the parity tests' (the compilation cache
# shares them), and the logits can be checked against PyTorch's too.
FORWARD_INPUTS = {name: value for name, value in np.load(CHECKPOINT / "reference.npz").items()
                  if name in ("input_ids", "attention_mask")}
# Transformers' greedy generation on this checkpoint (tests/fixtures/generation, the inference tests' fixture).
GENERATION = dict(np.load(CHECKPOINT.parents[1] / "generation" / "qwen3_moe.npz"))
TRAIN_STEPS = 5
# Weights held quantised, read by each process for its own devices: the Qwen3-MoE fixture quantised to FP8 as it is
# read, and a gpt-oss MXFP4 checkpoint (written into the work directory by the one-process side) kept as stored.
QUANTIZED_LAYOUT = dict(fsdp_size=8, ep_size=8)


def quantized_loads(workdir) -> dict:
    """name -> (checkpoint, from_pretrained options, vocabulary size)."""
    return {"fp8_on_load": (CHECKPOINT, {"quantize": "fp8"}, 128),
            "kept_mxfp4": (workdir / "mxfp4", {"dequantize": False}, 64)}


def train(train_step, checkpoints=None, restore_from=None) -> tuple[np.ndarray, float]:
    """TRAIN_STEPS steps from the start (saved at the last with `checkpoints`) or from `restore_from`'s latest
    state; returns the losses of those steps and the loss of the step after them."""
    records = []

    def run(state, until_step, capacity_state=None):
        loop = TrainLoop(train_step, FixtureBatches(), on_step=records.append,
                         should_save=checkpoints.should_save if checkpoints else None,
                         save=checkpoints.save if checkpoints else None)
        return loop.run(state, until_step, capacity_state)

    if restore_from is not None:
        state, capacity_state = restore_from.restore()
    else:
        # At the largest capacity: one compilation (the ladder's rungs would each compile, in both jobs).
        largest = train_step.model.capacity_schedule.largest
        state, capacity_state = run(train_step.init_state(capacity=largest), TRAIN_STEPS)
        if checkpoints is not None:
            checkpoints.wait()
    run(state, TRAIN_STEPS + 1, capacity_state)
    losses = np.asarray([record["loss"] for record in records])
    return losses[:-1], float(losses[-1])


def forward(model, vocab_size: int = 128) -> np.ndarray:
    ids = FORWARD_INPUTS["input_ids"] % vocab_size
    return np.asarray(to_host(model(ids, FORWARD_INPUTS["attention_mask"])))


def generate(model) -> np.ndarray:
    """Greedy tokens for the fixture's prompts ([3, 7], left-padded; fewer rows than data-parallel groups)."""
    return model.generate(GENERATION["input_ids"], GENERATION["attention_mask"], max_new_tokens=NEW_TOKENS,
                          do_sample=False)


def export_loaded(model, out_dir) -> None:
    model.save_pretrained(out_dir, max_shard_bytes=50_000, progress=False)
