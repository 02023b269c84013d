"""The layout flags every `moe-jax` command shares, and the `DistributedConfig` they spell.

    add_layout_flags(parser)                        # --tp --fsdp --ep --dp-replicate [--pp] [--ep-implementation]
    config = distributed_config_from_flags(args)    # DistributedConfig(tp_size=args.tp, ...)

Kept free of JAX imports so `moe-jax --help` stays fast.
"""

from __future__ import annotations

import argparse

# flag -> DistributedConfig field
LAYOUT_FLAGS = {"tp": "tp_size", "fsdp": "fsdp_size", "ep": "ep_size", "dp_replicate": "dp_replicate_size",
                "pp": "pp_size", "ep_implementation": "ep_implementation"}


def add_layout_flags(parser: argparse.ArgumentParser, *, pipeline: bool = True,
                     ep_implementation: bool = False, what: str = "") -> None:
    """Add --tp/--fsdp/--ep/--dp-replicate (and --pp, --ep-implementation when asked) to `parser`."""
    parser.add_argument("--tp", type=int, default=None, help=f"tp_size{what}")
    parser.add_argument("--fsdp", type=int, default=None, help=f"fsdp_size{what}")
    parser.add_argument("--ep", type=int, default=None, help=f"ep_size{what}")
    parser.add_argument("--dp-replicate", type=int, default=None, help=f"dp_replicate_size (HSDP replicas){what}")
    if pipeline:
        parser.add_argument("--pp", type=int, default=None, help="pp_size")
    if ep_implementation:
        parser.add_argument("--ep-implementation", default="auto",
                            help="a registered EP implementation: auto, all_to_all, all_reduce, ...")


def distributed_config_from_flags(args: argparse.Namespace):
    """The `DistributedConfig` of the layout flags present on `args` (absent flags keep its defaults)."""
    from .distributed.config import DistributedConfig

    values = {field: getattr(args, flag) for flag, field in LAYOUT_FLAGS.items() if hasattr(args, flag)}
    return DistributedConfig(**values)
