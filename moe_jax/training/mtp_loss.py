"""DeepSeek-V3's multi-token-prediction (MTP) loss in the train step (off by default).

    make_train_step(model, optimizer, mtp_loss_coef=0.3)     # a model holding MTP layers (`models.mtp`)

The loss gains `coef * mtp_loss`, mtp_loss = (1 / D) * sum over depths k = 1..D of L_k (the paper's
lambda / D * sum_k L_k), L_k the cross entropy of depth k's logits at position i against token i + k + 1,
averaged over the tokens depth k predicts in the global batch. Depth k's targets are the main loss's shifted by k
more, with its rules: labels (-100 not counted), nothing predicted from padding, nor across a packed document's
end. Reported (unscaled) as the `mtp_loss` metric. Gradients reach the MTP layers (their own embedding and
shared head included) and, through the last hidden states they read, the main model.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..models.mtp import shift_left
from .loss import IGNORE_INDEX, predicted_tokens


def mtp_targets(targets: jax.Array, attention_mask: jax.Array | None, depth: int) -> jax.Array:
    """targets: [B, S] (`loss.prediction_targets`: the token position i predicts); attention_mask: [B, S] 0/1, or
    packed rows' document ids -> depth `depth`'s targets [B, S]: targets[:, i + depth] where position i and
    i + depth are real tokens of the same document, else -100."""
    shifted = shift_left(targets, depth, IGNORE_INDEX)
    if attention_mask is None:
        return shifted
    same = (attention_mask > 0) & (shift_left(attention_mask, depth, 0) == attention_mask)
    return jnp.where(same, shifted, IGNORE_INDEX)


@dataclass(frozen=True)
class MtpLoss:
    """The MTP term of one train step: `coef` times the mean over the model's `depths` MTP layers."""

    coef: float
    depths: int

    @classmethod
    def of(cls, model, coef: float) -> MtpLoss | None:
        """The term at `coef` (None for 0); ValueError for a negative coefficient or a model it cannot train."""
        coef = float(coef)
        if coef < 0:
            raise ValueError(f"mtp_loss_coef={coef} must be >= 0 (0: no multi-token-prediction loss).")
        if not coef:
            return None
        if not getattr(model, "mtp_layers", 0):
            raise ValueError(
                f"mtp_loss_coef={coef} trains multi-token-prediction layers, which this {model.config.model_type} "
                "model does not hold: load a checkpoint that has them (DeepSeek-V3's model.layers.{"
                "num_hidden_layers}.*, num_nextn_predict_layers of them), or train with mtp_loss_coef=0.")
        if model.layer_stack.pipeline is not None:
            raise ValueError(f"mtp_loss_coef={coef} runs the MTP layers after the last decoder layer, which pipeline "
                             "stages do not hand back: train with pp_size=1, or without the MTP loss.")
        return cls(coef, model.mtp_layers)

    def targets(self, targets: jax.Array, attention_mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """targets, attention_mask: [B, S] of the global batch -> (every depth's targets [B, D, S], the weight
        [D] of each depth's summed cross entropy in the loss: coef / (D * the tokens that depth predicts))."""
        per_depth = jnp.stack([mtp_targets(targets, attention_mask, depth) for depth in range(1, self.depths + 1)],
                              axis=1)
        counts = jnp.stack([predicted_tokens(per_depth[:, depth]) for depth in range(self.depths)])
        return per_depth, self.coef / (self.depths * counts)

    def mean_loss(self, sums: jax.Array, weights: jax.Array) -> jax.Array:
        """sums: [D] each depth's summed cross entropy over the batch; weights: [D] (`targets`) -> mtp_loss, the mean
        over depths of each depth's mean cross entropy."""
        return jnp.sum(sums * weights) / self.coef
