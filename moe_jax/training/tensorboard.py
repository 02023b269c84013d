"""Training metrics as TensorBoard event files (through tensorboardX, a kept writer that needs neither
TensorFlow nor torch), beside the JSONL.

    writer = TensorBoardWriter("tb/")          # tensorboard --logdir tb/
    writer(record)                             # every numeric field of a TrainLoop record, at record["step"]
    writer.close()

Scalars are grouped as TensorBoard shows them: train/* (loss, ce_loss, aux_loss, grad_norm, lr), eval/*
(eval_loss, eval_perplexity), throughput/* (tokens_per_s, per device, model TFLOP/s per device, mfu) and
dispatch/* (capacity, required_capacity, replays).
"""

from __future__ import annotations

GROUPS = {
    "train": ("loss", "ce_loss", "aux_loss", "grad_norm", "lr"),
    "eval": ("eval_loss", "eval_perplexity"),
    "throughput": ("tokens_per_s", "tokens_per_s_per_device", "model_tflops_per_s_per_device", "mfu",
                   "packing_efficiency"),
    "dispatch": ("capacity", "required_capacity", "replays"),
}


class TensorBoardWriter:
    def __init__(self, logdir):
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
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
