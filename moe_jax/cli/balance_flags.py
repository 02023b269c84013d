"""`moe-jax train`'s expert load balance flags (`moe_jax.training.balance`; both off by default), and its
multi-token-prediction loss flag (`moe_jax.training.mtp_loss`; off by default):

    moe-jax train ... --router-aux-loss-coef 1e-3        # the family's aux loss on, whatever config.json says
    moe-jax train ... --router-z-loss-coef 1e-3          # ST-MoE's router z-loss joins the loss
    moe-jax train ... --router-bias-update-rate 1e-3     # DeepSeek-V3: move the router bias toward balance
    moe-jax train ... --ep 8 --num-redundant-experts 8 --rebalance-every 100   # EPLB: replicas of busy experts
    moe-jax train ... --rebalance-every 3 --rebalance-lookahead 3   # ... serving the next 3 batches' loads each
    moe-jax serve ... --ep 8 --num-redundant-experts 8 --rebalance-every 1000  # the same, every 1000 engine steps
    moe-jax train --model DeepSeek-V3/ ... --mtp-loss-coef 0.3   # DeepSeek-V3's MTP layers trained beside the model

A negative value is refused with one `error:` line before anything starts; a bias update on a family without a
router bias is refused, naming the families that have one, from config.json before any weight is read, and so is
an aux loss for a family whose reference computes none;
--rebalance-every without --num-redundant-experts (or --rebalance-lookahead without --rebalance-every) is refused
before anything starts, and a number of redundant
slots the layout cannot take when the model is built; an MTP loss for a model without MTP layers (a checkpoint
that holds none) when the step is built.
"""

from __future__ import annotations

import argparse


def add_balance_flags(parser: argparse.ArgumentParser) -> None:
    balance = parser.add_argument_group("expert load balance")
    balance.add_argument("--router-aux-loss-coef", type=float, default=None, metavar="C",
                         help="add C x the family's load-balancing aux loss to the loss (config.json's "
                              "output_router_logits and router_aux_loss_coef for this run, and in --export-hf's "
                              "config; 0 turns it off; default: as config.json says)")
    balance.add_argument("--router-z-loss-coef", type=float, default=0.0, metavar="C",
                         help="add C x ST-MoE's router z-loss (mean over tokens of logsumexp(router logits)^2, "
                              "averaged over sparse layers) to the loss; reported as router_z_loss (default 0: off)")
    balance.add_argument("--router-bias-update-rate", type=float, default=0.0, metavar="GAMMA",
                         help="after each step move every sparse layer's router bias (DeepSeek-V3's "
                              "e_score_correction_bias) by GAMMA x sign(mean load - load) per expert: "
                              "aux-loss-free balancing (default 0: the bias stays as loaded)")
    add_slot_flags(balance)
    balance.add_argument("--rebalance-lookahead", type=int, default=None, metavar="B",
                         help="each re-placement also serves the next B batches' loads under the updated "
                              "parameters: B forward passes per re-placement (default 1; at most --rebalance-every)")
    parser.add_argument_group("multi-token prediction").add_argument(
        "--mtp-loss-coef", type=float, default=0.0, metavar="LAMBDA",
        help="add LAMBDA x the mean over depths of the multi-token-prediction layers' cross entropies (DeepSeek-V3's "
             "MTP loss; a checkpoint holding MTP layers) to the loss; reported as mtp_loss (default 0: off)")


def add_slot_flags(parser, steps: str = "steps") -> None:
    """--num-redundant-experts and --rebalance-every (`moe-jax train`: optimizer steps; `serve`: engine steps)."""
    parser.add_argument("--num-redundant-experts", type=int, default=0, metavar="R",
                        help="R extra expert slots per sparse layer over the ep ranks ((E + R) %% ep == 0; needs "
                             "--ep > 1), filled with replicas of the busiest experts (default 0: none)")
    parser.add_argument("--rebalance-every", type=int, default=None, metavar="N",
                        help=f"re-place the experts into the slots every N {steps}, from the real tokens each expert "
                             "got in the last N (DeepSeek's EPLB; needs --num-redundant-experts)")


def check_balance_flags(args, config: dict) -> None:
    """The flags' values, and a router bias update against the family of config.json's values `config`."""
    for flag in ("router_z_loss_coef", "router_bias_update_rate", "mtp_loss_coef"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 0 (0 turns it off).")
    check_slot_flags(args)
    if args.rebalance_lookahead is not None:
        if args.rebalance_lookahead < 1:
            raise ValueError(f"--rebalance-lookahead {args.rebalance_lookahead} must be >= 1 (batches whose load a "
                             "re-placement measures).")
        if args.rebalance_every is None:
            raise ValueError("--rebalance-lookahead sets what each re-placement measures: pass --rebalance-every N "
                             "too.")
        if args.rebalance_lookahead > args.rebalance_every:
            raise ValueError(f"--rebalance-lookahead {args.rebalance_lookahead} would measure batches past the next "
                             f"re-placement (--rebalance-every {args.rebalance_every}): use at most "
                             f"{args.rebalance_every}.")
    check_router_bias(config, args.router_bias_update_rate)
    check_router_aux_loss(config, args.router_aux_loss_coef)


def check_slot_flags(args) -> None:
    if args.num_redundant_experts < 0:
        raise ValueError(f"--num-redundant-experts {args.num_redundant_experts} must be >= 0 (0 turns it off).")
    if args.rebalance_every is not None:
        if args.rebalance_every < 1:
            raise ValueError(f"--rebalance-every {args.rebalance_every} must be >= 1 (steps between re-placements).")
        if not args.num_redundant_experts:
            raise ValueError("--rebalance-every re-places experts into redundant expert slots: pass "
                             "--num-redundant-experts R (R > 0, with --ep > 1) too.")


def balance_options(args) -> dict:
    """`make_train_step`'s keyword arguments for the flags."""
    return {"router_z_loss_coef": args.router_z_loss_coef, "router_bias_update_rate": args.router_bias_update_rate,
            "mtp_loss_coef": args.mtp_loss_coef}


def check_router_bias(config: dict, rate: float) -> None:
    """Refuse a bias update (rate > 0) for the model of config.json's values `config` if its sparse layers hold no
    router bias: from the config alone, before any weight is read."""
    if not rate:
        return
    from ..causal_lm.families import model_class_for
    from ..training.balance import no_router_bias

    if not _has_router_bias(model_class_for(config), config):
        raise ValueError(no_router_bias(float(rate), config["model_type"]))


def check_router_aux_loss(config: dict, coef: float | None) -> None:
    """Refuse --router-aux-loss-coef (negative, or for a family whose reference computes no aux loss)."""
    if coef is None:
        return
    if coef < 0:
        raise ValueError(f"--router-aux-loss-coef {coef} must be >= 0 (0 turns the aux loss off).")
    from ..causal_lm.families import model_class_for

    if coef and not model_class_for(config).family.has_router_aux_loss:
        raise ValueError(f"--router-aux-loss-coef {coef}: a {config['model_type']} model has no router aux loss (its "
                         "reference computes none); balance it with --router-bias-update-rate where its router "
                         "has a bias, or --router-z-loss-coef.")


def with_router_aux_loss(config: dict, coef: float | None) -> dict:
    """config.json's values with the aux loss --router-aux-loss-coef asks for (unchanged without the flag)."""
    if coef is None:
        return config
    return {**config, "output_router_logits": coef > 0, "router_aux_loss_coef": coef}


def collapse_remedy(args, config: dict) -> str:
    """The flag a collapsing router's warning names (`training.router_health`): the balance term this model's
    family has, or a larger value of the one the run already uses."""
    from ..causal_lm.families import model_class_for

    model_class = model_class_for(config)
    if _has_router_bias(model_class, config):
        rate = args.router_bias_update_rate
        return (f"a larger --router-bias-update-rate than {rate:g}" if rate
                else "--router-bias-update-rate GAMMA (e.g. 1e-3)")
    if model_class.family.has_router_aux_loss:
        values = model_class.config_class.from_dict(config)
        coef = values.router_aux_loss_coef if values.output_router_logits else 0.0
        return f"a larger --router-aux-loss-coef than {coef:g}" if coef else "--router-aux-loss-coef C (e.g. 1e-2)"
    return "--router-z-loss-coef C (e.g. 1e-3; this family has neither an aux loss nor a router bias)"


def _has_router_bias(model_class, config: dict) -> bool:
    from ..module_tree import ModuleTree
    from ..training.balance import ROUTER_BIAS

    family, values, tree = model_class.family, model_class.config_class.from_dict(config), ModuleTree()
    family.declare_sparse_mlp(tree, values, family.experts_intermediate_size(values))
    return any(buffer.endswith("." + ROUTER_BIAS) for buffer in tree.buffers())
