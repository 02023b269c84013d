"""What is being planned: the workload (training or serving), its batch and the settings the step is built with.

    request = PlanRequest(mode="train", batch_size=16, seq_len=4096, dtype="bfloat16", optimizer="adamw")
    request.model_options()     # keyword arguments of the model (dtype, remat)

Checked when built, so a bad value fails before any layout is tried, with the value and its fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..parameter_dtypes import parameter_dtype
from ..training.optimizers import OPTIMIZERS

MODES = ("train", "serve")
REMAT_CHOICES = ("none", "full", "dots_saveable")
OFFLOADED = {"optimizer": "optimizer state", "parameters": "parameters", "all": "parameters and optimizer state"}


@dataclass(frozen=True)
class PlanRequest:
    """mode: "train" (one optimizer step on `batch_size` sequences of `seq_len` tokens) or "serve" (one
    decode step of `max_slots` running requests, with a KV cache of `max_model_len` tokens per slot).
    dtype: the parameters' dtype; mixed_precision: float32 parameters and bfloat16 compute (as `moe-jax train
    --mixed-precision`); optimizer: "adamw", "muon" or "sgd"; grad_accum: micro-batches per step; remat: what each
    layer keeps for the backward pass; offload: the train state kept in pinned host memory between steps
    ("optimizer", "parameters", "all" or None, as `make_train_step(offload=)`)."""

    mode: str = "train"
    batch_size: int = 8
    seq_len: int = 2048
    dtype: str = "float32"
    optimizer: str = "adamw"
    mixed_precision: bool = False
    grad_accum: int = 1
    remat: str = "none"
    max_slots: int = 8
    max_model_len: int = 2048
    offload: str | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {list(MODES)} (--train or --serve).")
        for name in ("batch_size", "seq_len", "grad_accum", "max_slots", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1.")
        parameter_dtype(self.dtype)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not one of {sorted(OPTIMIZERS)}.")
        if self.remat not in REMAT_CHOICES:
            raise ValueError(f"remat {self.remat!r} is not one of {list(REMAT_CHOICES)}.")
        if self.offload is not None:
            if self.mode != "train":
                raise ValueError(f"offload={self.offload!r} places a train state: plan or compile it with --train.")
            if self.offload not in OFFLOADED:
                raise ValueError(f"offload={self.offload!r}: choose one of {sorted(OFFLOADED)} (or None: nothing "
                                 "offloaded).")
        if self.mixed_precision and parameter_dtype(self.dtype).name != "float32":
            raise ValueError(f"mixed precision keeps float32 master parameters; drop --dtype {self.dtype} "
                             "(or use --dtype float32) with --mixed-precision.")

    @property
    def compute_dtype(self) -> str:
        """The dtype the dots run in: bfloat16 under mixed precision, else the parameters'."""
        return "bfloat16" if self.mixed_precision else parameter_dtype(self.dtype).name

    @property
    def tokens(self) -> int:
        """Tokens one step processes: the batch's in training, one per slot when serving."""
        return self.batch_size * self.seq_len if self.mode == "train" else self.max_slots

    def model_options(self) -> dict:
        return {"dtype": self.dtype, "remat": self.remat}

    def describe(self) -> str:
        if self.mode == "train":
            precision = "mixed precision (float32 masters, bfloat16 compute)" if self.mixed_precision else self.dtype
            return (f"train: batch {self.batch_size} x {self.seq_len} tokens, {precision}, {self.optimizer}"
                    + (f", grad_accum {self.grad_accum}" if self.grad_accum > 1 else "")
                    + (f", remat {self.remat}" if self.remat != "none" else "")
                    + (f", {OFFLOADED[self.offload]} in host memory" if self.offload else ""))
        return f"serve: one decode step of {self.max_slots} slots, KV cache of {self.max_model_len} tokens per slot"
