"""Record PyTorch's bf16 logits under 2-way tensor parallelism (HF native TP, CPU, gloo) as a fixture key.

    pip install torch==2.13.0 transformers==5.23.0
    python scripts/make_tp_reference_fixtures.py [FAMILY ...]      # default: every family

For each family in `tests/fixtures/models/`, the script launches `torchrun --nproc_per_node 2` on itself
(`OMP_NUM_THREADS=1`, CPU, gloo backend), and each rank loads the committed checkpoint with

    AutoModelForCausalLM.from_pretrained(checkpoint, dtype=..., distributed_config=DistributedConfig(tp_size=2))

(the model's predefined `base_model_tp_plan`), once in fp32 and once in bf16, and runs the fixture's inputs
(`reference.npz`: input_ids, attention_mask, `output_router_logits=True`, as `fixture_arrays` does).

- fp32 TP logits are a sanity check: they must reproduce `reference.npz`'s one-process fp32 logits to 1e-5
  (the TP run is correct); otherwise the family is not written.
- bf16 TP logits (as float32) are added to `reference_low_precision.npz` as `logits_bfloat16_tp2`; the
  existing keys (`logits_bfloat16`, `logits_float16`) are loaded and re-saved unchanged.

It prints, for each family, max and rms of |logits - fp32 logits| over real tokens (attention_mask == 1) for
the one-process bf16 run (`logits_bfloat16`) and for the tp2 bf16 run, and the fp32 TP sanity max diff. A
family whose TP run fails is reported with its error and skipped (its file is left as it is).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "models"
FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss", "deepseek_v3", "llama4_text")
TP_SIZE = 2
FP32_ATOL = 1e-5
NEW_KEY = f"logits_bfloat16_tp{TP_SIZE}"


def _tp_logits(checkpoint: Path, dtype_name: str, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """The full logits [8, 12, V] (float32) of a TP run; called on every rank."""
    import torch
    import transformers
    from transformers.distributed.configuration_utils import DistributedConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=getattr(torch, dtype_name), distributed_config=DistributedConfig(tp_size=TP_SIZE)
    ).eval()
    sharded = [name for name, parameter in model.named_parameters() if hasattr(parameter, "placements")
               and any(placement.is_shard() for placement in parameter.placements)]
    if not sharded:  # TP silently not applied: this run would only repeat the one-process logits
        raise RuntimeError(f"no parameter is sharded over tp (plan {getattr(model, '_tp_plan', None)})")
    _tp_logits.sharded = sharded
    with torch.no_grad():
        output = model(input_ids=torch.as_tensor(input_ids), attention_mask=torch.as_tensor(attention_mask),
                       output_router_logits=True)
    logits = output.logits
    if hasattr(logits, "full_tensor"):  # a DTensor (lm_head output not gathered)
        logits = logits.full_tensor()
    return logits.float().numpy()


def worker(families: list[str], out_dir: Path) -> None:
    """Per-rank body under torchrun: rank 0 writes `<family>.npz` or `<family>.error.txt` into out_dir."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    for family in families:
        checkpoint = FIXTURES / family
        reference = np.load(checkpoint / "reference.npz")
        result, error = {}, None
        try:
            for dtype_name in ("float32", "bfloat16"):
                result[dtype_name] = _tp_logits(checkpoint, dtype_name, reference["input_ids"],
                                                reference["attention_mask"])
        except Exception:  # noqa: BLE001 - reported and skipped
            error = traceback.format_exc()
        # Both ranks must agree on the logits (each computes the full, replicated output).
        if error is None:
            other = [None, None]
            dist.all_gather_object(other, result["bfloat16"])
            if not np.array_equal(other[0], other[1]):
                error = "ranks disagree on the bf16 TP logits"
        if rank == 0:
            if error is None:
                np.savez(out_dir / f"{family}.npz", **result)
                (out_dir / f"{family}.sharded.json").write_text(json.dumps(_tp_logits.sharded))
            else:
                (out_dir / f"{family}.error.txt").write_text(error)
        dist.barrier()
    dist.destroy_process_group()


def _stats(logits: np.ndarray, fp32: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    err = np.abs(logits.astype(np.float64) - fp32.astype(np.float64))[mask.astype(bool)]
    return float(err.max()), float(np.sqrt(np.mean(err**2)))


def main(families: list[str]) -> int:
    unknown = [family for family in families if family not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; choose from {list(FAMILIES)}")
    failed = {}
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        for family in families:  # one torchrun per family: a crash in one does not take the others down
            env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(TP_SIZE),
                       "--master_port", str(29500 + FAMILIES.index(family)), str(Path(__file__).resolve()),
                       "--worker", str(out_dir), family]
            proc = subprocess.run(command, env=env, capture_output=True, text=True)
            result_path = out_dir / f"{family}.npz"
            error_path = out_dir / f"{family}.error.txt"
            if error_path.exists():
                failed[family] = error_path.read_text().strip().splitlines()[-1]
                print(f"{family}: TP run failed:\n{error_path.read_text()}", file=sys.stderr)
                continue
            if proc.returncode != 0 or not result_path.exists():
                failed[family] = f"torchrun exited {proc.returncode}"
                print(f"{family}: torchrun exited {proc.returncode}:\n{proc.stderr[-4000:]}", file=sys.stderr)
                continue
            result = np.load(result_path)
            reference = np.load(FIXTURES / family / "reference.npz")
            low_path = FIXTURES / family / "reference_low_precision.npz"
            low = dict(np.load(low_path))
            fp32, mask = reference["logits"], reference["attention_mask"]
            sanity = float(np.abs(result["float32"] - fp32)[mask.astype(bool)].max())
            one_max, one_rms = _stats(low["logits_bfloat16"], fp32, mask)
            tp_max, tp_rms = _stats(result["bfloat16"], fp32, mask)
            rows.append((family, one_max, one_rms, tp_max, tp_rms, sanity))
            sharded = json.loads((out_dir / f"{family}.sharded.json").read_text())
            layer_kinds = sorted({".".join(n.split(".")[3:]) if n.startswith("model.layers.") else n for n in sharded})
            notes.append(f"{family}: {len(sharded)} sharded parameters: {', '.join(layer_kinds)}")
            if not sanity <= FP32_ATOL:
                failed[family] = f"fp32 TP logits differ from reference.npz by {sanity:.3g} > {FP32_ATOL}"
                continue
            low[NEW_KEY] = result["bfloat16"].astype(np.float32)
            np.savez(low_path, **low)
    print(f"\n|logits - fp32 logits| over real tokens (attention_mask == 1); tp{TP_SIZE} runs on CPU, 2 processes")
    print(f"{'family':<12} {'1-proc bf16 max':>15} {'rms':>9} {'tp2 bf16 max':>13} {'rms':>9} "
          f"{'max ratio':>9} {'rms ratio':>9} {'fp32 tp2 sanity':>15}")
    for family, one_max, one_rms, tp_max, tp_rms, sanity in rows:
        print(f"{family:<12} {one_max:>15.3e} {one_rms:>9.3e} {tp_max:>13.3e} {tp_rms:>9.3e} "
              f"{tp_max / one_max:>9.2f} {tp_rms / one_rms:>9.2f} {sanity:>15.2e}")
    print("\nWhat the model's predefined TP plan shards (model.layers.N. prefix dropped):")
    print("\n".join(notes))
    for family, reason in failed.items():
        print(f"{family}: not written ({reason})")
    print(json.dumps({"written": [r[0] for r in rows if r[0] not in failed], "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[3:], Path(sys.argv[2]))
    else:
        sys.exit(main(sys.argv[1:] or list(FAMILIES)))
