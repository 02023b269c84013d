"""`moe-jax train`'s expert load balance flags (`moe_jax.training.balance`; both off by default):

    moe-jax train ... --router-z-loss-coef 1e-3          # ST-MoE's router z-loss joins the loss
    moe-jax train ... --router-bias-update-rate 1e-3     # DeepSeek-V3: move the router bias toward balance

A negative value is refused with one `error:` line before anything starts; a bias update on a family without a
router bias is refused, naming the families that have one, when the step is built (before the first step).
"""

from __future__ import annotations

import argparse


def add_balance_flags(parser: argparse.ArgumentParser) -> None:
    balance = parser.add_argument_group("expert load balance")
    balance.add_argument("--router-z-loss-coef", type=float, default=0.0, metavar="C",
                         help="add C x ST-MoE's router z-loss (mean over tokens of logsumexp(router logits)^2, "
                              "averaged over sparse layers) to the loss; reported as router_z_loss (default 0: off)")
    balance.add_argument("--router-bias-update-rate", type=float, default=0.0, metavar="GAMMA",
                         help="after each step move every sparse layer's router bias (DeepSeek-V3's "
                              "e_score_correction_bias) by GAMMA x sign(mean load - load) per expert: "
                              "aux-loss-free balancing (default 0: the bias stays as loaded)")


def check_balance_flags(args) -> None:
    for flag in ("router_z_loss_coef", "router_bias_update_rate"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 0 (0 turns it off).")


def balance_options(args) -> dict:
    """`make_train_step`'s keyword arguments for the flags."""
    return {"router_z_loss_coef": args.router_z_loss_coef, "router_bias_update_rate": args.router_bias_update_rate}
