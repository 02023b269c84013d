"""Training metrics as TensorBoard event files (through tensorboardX, a kept writer that needs neither
TensorFlow nor torch), beside the JSONL.

    writer = TensorBoardWriter("tb/")          # tensorboard --logdir tb/
    writer(record)                             # every numeric field of a TrainLoop record, at record["step"]
    writer.close()

Scalars are grouped as TensorBoard shows them: train/* (loss, ce_loss, aux_loss, router_z_loss, mtp_loss,
grad_norm, lr), eval/* (eval_loss, eval_perplexity), throughput/* (tokens_per_s, per device, model TFLOP/s per
device, mfu, packing efficiency) and dispatch/* (capacity, required_capacity, padded buffer rows, replays). A
record with `expert_load` (per sparse layer, tokens per expert) adds, per layer L (the model's layer index: the record's
`expert_load_layers`, else `sparse_layers`, else the row's position), the histogram router_load/layer_L (one bucket per expert: its x axis is the expert
id, its height the tokens routed there) and the scalar router_load/layer_L_max_over_mean (1.0: perfectly
balanced; E / K: every token on the same K experts). A record with `ep_rank_load` (per sparse layer, the (token,
expert) pairs each ep rank computed) adds the scalar ep_rank_load/layer_L_max_over_mean: the busiest rank's work
over the mean, what a step waits for (1.0: even; ep: one rank did it all).
"""

from __future__ import annotations

import numpy as np

GROUPS = {
    "train": ("loss", "ce_loss", "aux_loss", "router_z_loss", "mtp_loss", "grad_norm", "lr"),
    "eval": ("eval_loss", "eval_perplexity"),
    "throughput": ("tokens_per_s", "tokens_per_s_per_device", "model_tflops_per_s_per_device", "mfu",
                   "packing_efficiency", "save_wait_s"),
    "dispatch": ("capacity", "required_capacity", "padded", "replays"),
    "rl": ("reward", "clip_fraction", "logprob_gap", "routing_mismatch", "kl"),   # scripts/rl_grpo.py's records
}


def load_imbalance(load) -> np.ndarray:
    """Per layer, the busiest expert's tokens over the mean: load [L, E] -> [L] (1.0 when balanced)."""
    load = np.asarray(load, np.float64)
    return load.max(axis=-1) / np.maximum(load.mean(axis=-1), 1e-12)


class TensorBoardWriter:
    def __init__(self, logdir, sparse_layers: list[int] | None = None):
        self.sparse_layers = sparse_layers
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ImportError('--tensorboard needs tensorboardX: pip install "moe_jax[tensorboard]" '
                              "(or pip install tensorboardX).") from None
        self.writer = SummaryWriter(str(logdir))

    def __call__(self, record: dict) -> None:
        step = int(record["step"])
        for group, names in GROUPS.items():
            for name in names:
                value = record.get(name)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(f"{group}/{name}", float(value), step)
        if record.get("expert_load") is not None:
            self._router_load(np.asarray(record["expert_load"], np.float64), step,
                              self._layers(record, len(record["expert_load"])))
        if record.get("ep_rank_load") is not None:
            for layer, imbalance in zip(self._layers(record, len(record["ep_rank_load"])),
                                        load_imbalance(record["ep_rank_load"])):
                self.writer.add_scalar(f"ep_rank_load/layer_{layer}_max_over_mean", float(imbalance), step)
        self.writer.flush()

    def _layers(self, record: dict, rows: int):
        """The model layer index of each load row: the record's expert_load_layers, else sparse_layers, else the
        row's position."""
        return record.get("expert_load_layers") or (self.sparse_layers if self.sparse_layers is not None
                                                     else range(rows))

    def _router_load(self, load: np.ndarray, step: int, layers) -> None:
        experts = np.arange(load.shape[-1], dtype=np.float64)
        for layer, counts, imbalance in zip(layers, load, load_imbalance(load)):
            # One bucket per expert (edges at e + 0.5): the "histogram" of which experts the tokens chose.
            total = counts.sum()
            self.writer.add_histogram_raw(
                f"router_load/layer_{layer}", min=0.0, max=float(len(counts) - 1), num=float(total),
                sum=float(experts @ counts), sum_squares=float((experts ** 2) @ counts),
                bucket_limits=(experts + 0.5).tolist(), bucket_counts=counts.tolist(), global_step=step)
            self.writer.add_scalar(f"router_load/layer_{layer}_max_over_mean", float(imbalance), step)

    def close(self) -> None:
        self.writer.close()
