"""`moe-jax demo`: build a tiny Qwen3-MoE checkpoint locally, load it sharded on 8 devices, and check it.

    1. a random tiny Qwen3-MoE (8 experts, 4 layers) is saved as an HF checkpoint (safetensors + config.json),
       with a byte-level tokenizer (id = UTF-8 byte: the vocabulary is 256), so `moe-jax generate` and
       `moe-jax train --text` work on it
    2. it is loaded with DistributedConfig(tp_size=2, fsdp_size=4, ep_size=4): each device reads only its slices
    3. the plan, every parameter's sharding and the device layout are printed
    4. a forward pass runs on the mesh and is compared with the same checkpoint on one device

On a CPU-only machine the 8 devices are virtual CPU devices (`moe_jax.host_devices.use_cpu_devices(8)`).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from ..host_devices import use_cpu_devices

DEMO_CONFIG = dict(
    model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
    num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True, max_position_embeddings=512,
    tie_word_embeddings=False,
)
DEMO_LAYOUT = dict(tp_size=2, fsdp_size=4, ep_size=4)
# The same helper under the name user scripts import from here (`moe_jax.host_devices.use_cpu_devices`).
ensure_virtual_cpu_devices = use_cpu_devices


def demo_devices(count: int = 8):
    import jax

    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    if len(accelerators) >= count:
        return accelerators[:count]
    cpus = jax.devices("cpu")
    if len(cpus) < count:
        raise ValueError(
            f"The demo needs {count} devices but JAX started with {len(cpus)} CPU device(s) "
            f"(XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}); run it with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count}, or without that flag in XLA_FLAGS "
            f"(the demo then asks for {count} itself)."
        )
    return cpus[:count]


def checkpoint_directory(output_dir: str | None) -> Path:
    """Where the demo writes its checkpoint: `output_dir` itself, so `--model OUTPUT_DIR` loads it (it must
    be new or empty: an earlier run's checkpoint is never overwritten); default: a new temporary directory."""
    if not output_dir:
        return Path(tempfile.mkdtemp(prefix="moe_jax_demo_"))
    checkpoint = Path(output_dir)
    if checkpoint.exists() and (not checkpoint.is_dir() or any(checkpoint.iterdir())):
        raise FileExistsError(
            f"--output-dir {checkpoint} exists and is not empty (an earlier demo run?); pass a new or empty "
            "directory."
        )
    return checkpoint


def run_demo(output_dir: str | None = None, seed: int = 0) -> float:
    """Returns the max abs difference between sharded and single-device logits (printed too).

    Raises ValueError when JAX has fewer than 8 devices and FileExistsError when `output_dir` exists and is
    not empty, before anything is written.
    """
    use_cpu_devices(8)
    import numpy as np

    from .. import AutoModelForCausalLM, DistributedConfig
    from ..reporting.plan_report import plan_report
    from ..tokenization import BYTE_CHAT_TEMPLATE, write_byte_tokenizer

    devices = demo_devices()
    checkpoint = checkpoint_directory(output_dir)

    print(f"[1/4] building a tiny random Qwen3-MoE and saving it as an HF checkpoint (with a byte-level "
          f"tokenizer) in {checkpoint}")
    reference = AutoModelForCausalLM.from_config(DEMO_CONFIG, devices=devices[:1])
    reference.init_params(seed)
    # A sharper router spreads tokens over the experts the way a trained one does.
    reference.params = {name: value * (8.0 if name.endswith("mlp.gate.weight") else 1.0)
                        for name, value in reference.params.items()}
    reference.save_pretrained(checkpoint, progress=False)
    write_byte_tokenizer(checkpoint, chat_template=BYTE_CHAT_TEMPLATE)   # so `moe-jax serve` can chat

    print(f"[2/4] loading it on {len(devices)} {devices[0].platform} devices with DistributedConfig({DEMO_LAYOUT})")
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, DistributedConfig(**DEMO_LAYOUT), devices=devices,
                                                 progress=False)
    print(f"      loaded in {time.perf_counter() - start:.2f} s")

    print("[3/4] plan, shardings and layout:\n")
    print(plan_report(model))
    print()

    print("[4/4] forward pass on the mesh vs the same checkpoint on one device")
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, DEMO_CONFIG["vocab_size"], (8, 16))
    single = AutoModelForCausalLM.from_pretrained(checkpoint, devices=devices[:1], progress=False)
    expected = np.asarray(single(input_ids))
    output = model.forward(input_ids)
    logits = np.asarray(output.logits)
    difference = float(np.max(np.abs(logits - expected)))
    print(f"      logits {list(logits.shape)}: max |sharded - single device| = {difference:.2e}")
    print(f"      dispatch: dropped pairs {int(output.statistics.dropped)}, padded slots "
          f"{int(output.statistics.padded)}, largest buffer {int(output.statistics.buffer_rows)} rows")
    print("      agreement: " + ("OK" if difference <= 1e-4 else "MISMATCH"))
    print(f"\nThe checkpoint stays in {checkpoint}: reuse it with --model, e.g. moe-jax generate --model "
          f"{checkpoint} --prompt Hi (or serve, train, plan)" + ("" if output_dir else "; --output-dir DIR keeps "
                                                                  "it somewhere of your choosing."))
    return difference
