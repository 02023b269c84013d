"""A router collapsing onto a few experts, said once: nothing else in a run reports it (the loss keeps falling while
most experts sit idle, and a model without an aux loss has nothing that pulls the tokens back).

    watch = RouterCollapseWatch()
    message = watch(record)        # each step's record (`TrainLoop`'s): warns once, and returns the warning's text
    RouterCollapseWatch(remedy="--router-aux-loss-coef C", report=print)   # a command's own remedy and channel

A sparse layer collapses, here, when its busiest expert gets more than `COLLAPSE_SHARE` times the mean tokens per
expert for `COLLAPSE_STEPS` steps in a row (an even router gives about 1; one that sends everything to k of E
experts gives E / k).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np

COLLAPSE_SHARE = 2.5
COLLAPSE_STEPS = 20
BALANCING = ("an aux loss (config.json: output_router_logits true and router_aux_loss_coef, e.g. 0.001), the "
             "router z-loss (moe-jax train --router-z-loss-coef C) or, for routers with a bias, aux-loss-free "
             "balancing (--router-bias-update-rate GAMMA)")


def _runtime_warning(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)   # at the watch's caller (the loop)


class RouterCollapseWatch:
    """remedy: what the message tells the user to turn on (default: every way to balance a router); report: how
    the message is issued (default: a RuntimeWarning; `moe-jax train` prints one `warning:` line)."""

    def __init__(self, share: float = COLLAPSE_SHARE, steps: int = COLLAPSE_STEPS, *, remedy: str = BALANCING,
                 report: Callable[[str], None] = _runtime_warning):
        self.share, self.steps, self.remedy, self.report = share, steps, remedy, report
        self.streaks: dict[int, int] = {}   # layer -> consecutive steps above `share`
        self.warned = False

    def __call__(self, record: dict) -> str | None:
        """record: a step's, with expert_load (per sparse layer, tokens per expert) and expert_load_layers (their
        layer indices) -> the warning's text the first time a layer has stayed above the share for the steps
        (also reported), else None."""
        if self.warned or "expert_load" not in record:
            return None
        load = np.asarray(record["expert_load"], np.float64)                      # [L, E]
        mean = load.mean(axis=1)
        shares = np.divide(load.max(axis=1), mean, out=np.zeros_like(mean), where=mean > 0)
        for layer, share in zip(record["expert_load_layers"], shares):
            self.streaks[layer] = self.streaks.get(layer, 0) + 1 if share > self.share else 0
            if self.streaks[layer] >= self.steps:
                self.warned = True
                message = (f"the router of layer {layer} has sent its busiest expert more than {self.share:g}x the "
                           f"mean tokens per expert for {self.steps} steps (now {share:.1f}x, step "
                           f"{record.get('step')}): it is collapsing onto a few experts. Balance it with "
                           f"{self.remedy}.")
                self.report(message)
                return message
        return None
