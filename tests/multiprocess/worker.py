"""One process of the 2-process x 4-device job that tests/multiprocess/test_multiprocess.py launches.

    moe-jax launch --nproc 2 --devices-per-process 4 -- python tests/multiprocess/worker.py WORKDIR

Loads the committed tiny Qwen3-MoE on two layouts (counting the checkpoint bytes this process reads),
trains 5 steps with orbax checkpoints, restores the state the one-process run saved in WORKDIR, exports
the loaded weights, generates, and feeds a token file by rows. Each process writes what it saw to
WORKDIR/process_{i}.npz; the test compares them with the same work done in one process.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import moe_jax.distributed  # noqa: E402

moe_jax.distributed.initialize()  # first: it decides which devices exist

import jax  # noqa: E402
import numpy as np  # noqa: E402

from converters.safetensors_io import record_reads  # noqa: E402
from moe_jax import AutoModelForCausalLM, DistributedConfig  # noqa: E402
from moe_jax.distributed.host_arrays import to_host  # noqa: E402
from moe_jax.inference import ContinuousBatchingConfig  # noqa: E402
from moe_jax.training import TrainCheckpoints  # noqa: E402
from moe_jax.training.data import TokenRows, place_batch  # noqa: E402
from tests.multiprocess.shared_work import (  # noqa: E402
    FORWARD_LAYOUTS,
    GENERATION,
    NEW_TOKENS,
    QUANTIZED_LAYOUT,
    TRAIN_LAYOUT,
    export_loaded,
    forward,
    generate,
    quantized_loads,
    train,
)
from tests.training.conftest import build_trainer  # noqa: E402
from tests.training.hf_training import CHECKPOINT  # noqa: E402


def main(workdir: Path) -> None:
    began = time.perf_counter()

    def phase(name: str) -> None:
        print(f"{name}: {time.perf_counter() - began:.1f} s", flush=True)

    assert jax.process_count() == 2 and jax.local_device_count() == 4, (jax.process_count(), jax.local_devices())
    seen: dict[str, np.ndarray] = {}
    for name, layout in FORWARD_LAYOUTS.items():
        with record_reads() as reads:
            model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, DistributedConfig(**layout), progress=False)
        seen[f"{name}/bytes_read"] = np.asarray(sum(read.nbytes for read in reads))
        seen[f"{name}/logits"] = forward(model)
        seen[f"{name}/ep_group_processes"] = np.asarray(
            [[model.mesh.devices.flat[rank].process_index for rank in group]
             for group in model.layout.device_groups("ep")])
        phase(f"load + forward {name}")
    for name, (checkpoint, options, vocab_size) in quantized_loads(workdir).items():
        with record_reads() as reads:
            quantized = AutoModelForCausalLM.from_pretrained(checkpoint, DistributedConfig(**QUANTIZED_LAYOUT),
                                                             progress=False, **options)
        seen[f"{name}/bytes_read"] = np.asarray(sum(read.nbytes for read in reads))
        seen[f"{name}/logits"] = forward(quantized, vocab_size)
        phase(f"load + forward {name}")
    seen["generated"] = generate(model)
    phase("generate")
    seen["batch_generated"], seen["served"] = continuous_batching(model)
    phase("continuous batching")
    export_loaded(model, workdir / "export_2proc")
    phase("export")

    model, train_step = build_trainer(TRAIN_LAYOUT)
    checkpoints = TrainCheckpoints(workdir / "state_2proc", model, train_step, save_every=5)
    seen["losses"], seen["next_loss"] = train(train_step, checkpoints)
    phase("train")
    one_process = TrainCheckpoints(workdir / "state_1proc", model, train_step)
    seen["next_loss_from_1proc_state"] = train(train_step, restore_from=one_process)[1]
    phase("restore + step")

    rows = np.arange(16 * 12, dtype=np.int32).reshape(16, 12)
    asked = []
    source = TokenRows(rows, batch_size=8)
    reader = source.batch_rows
    source.batch_rows = lambda index, wanted: asked.append(np.asarray(wanted)) or reader(index, wanted)
    seen["batch_1"] = to_host(place_batch(source, 1, model.batch_sharding())["input_ids"])
    seen["rows_asked"] = np.concatenate(asked)
    np.savez(workdir / f"process_{jax.process_index()}.npz", **seen)


def continuous_batching(model) -> tuple[np.ndarray, np.ndarray]:
    """The fixture's prompts through continuous batching, twice: `generate_batch` run alike by both processes,
    then a manager on process 0 leading the other process (the server's arrangement) -> new tokens [3, n]
    of each (the second on process 0 only; -1 elsewhere)."""
    mask = GENERATION["attention_mask"].astype(bool)
    prompts = [[int(t) for t in row[keep]] for row, keep in zip(GENERATION["input_ids"], mask)]
    # One engine config for both, one page per request (one page width: each program compiles once per process;
    # pages crossing boundaries are tests/inference/test_continuous.py's), prompts prefilled in chunks of 3.
    config = ContinuousBatchingConfig(max_slots=model.data_parallel_size, page_size=32, max_model_len=32,
                                      prefill_chunk=3)
    outputs = model.generate_batch(prompts, continuous_batching_config=config, max_new_tokens=NEW_TOKENS)
    batch = np.asarray([output.generated_tokens for output in outputs.values()])
    if jax.process_index() != 0:
        engine = model.continuous_batching_engine(config)
        assert engine.follow() > 0
        return batch, np.full_like(batch, -1)
    manager = model.init_continuous_batching(continuous_batching_config=config)
    manager.engine.lead()
    with manager:
        ids = [manager.add_request(prompt, max_new_tokens=NEW_TOKENS) for prompt in prompts]
        served = [manager.get_result(request_id, timeout=300).generated_tokens for request_id in ids]
    manager.engine.release_followers()
    return batch, np.asarray(served)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
