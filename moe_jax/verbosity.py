"""What moe_jax keeps quiet unless asked: `MOE_JAX_VERBOSE=1` shows it (the `--verbose` flag of every `moe-jax`
command sets it, and `moe-jax launch --verbose` passes it to its processes).

    gloo's "[Gloo] Rank i is connected to j peer ranks" lines: one per process and collective group (16 for two
    processes of 8 CPU devices); `moe-jax launch` leaves them out of what it relays
    the huge-pages hint of a Python program started without glibc's tunable (`moe_jax.host_memory`)
    Transformers' "PyTorch was not found" notice when it is imported without torch: moe_jax uses it for
    tokenizers only, which need no torch

Nothing here imports JAX or Transformers.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

VERBOSE = "MOE_JAX_VERBOSE"
GLOO_CONNECTED = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks")
NO_TORCH_NOTICE = "PyTorch was not found"


def verbose(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the quiet things are shown (`MOE_JAX_VERBOSE` set to anything but 0 or nothing)."""
    environ = os.environ if environ is None else environ
    return environ.get(VERBOSE, "0") not in ("", "0")


def set_verbose(on: bool = True) -> None:
    """Show (or hide) the quiet things in this process and the processes it starts."""
    os.environ[VERBOSE] = "1" if on else "0"


def is_gloo_connection_line(line: bytes) -> bool:
    return GLOO_CONNECTED.match(line) is not None


# JAX's preemption notifier logs the SIGTERM it catches as a C++ warning; a preempted training run says so itself.
PREEMPTION_NOTICE = re.compile(rb"^W\d{4} [\d:.]+\s+\d+ preemption_notifier\.cc:\d+\] SIGTERM caught")


def is_quiet_line(line: bytes) -> bool:
    """Lines a launcher relays only when verbose: gloo's connection lines, JAX's preemption notice."""
    return is_gloo_connection_line(line) or PREEMPTION_NOTICE.match(line) is not None


class _NoTorchNotice(logging.Filter):
    """Drops Transformers' notice that torch is missing, unless verbose (decided when it is logged)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return verbose() or not record.getMessage().startswith(NO_TORCH_NOTICE)


def quiet_transformers_notice() -> None:
    """Install the filter on Transformers' root logger (idempotent; Transformers need not be imported yet: it
    logs the notice on that logger while it is first imported)."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(existing, _NoTorchNotice) for existing in logger.filters):
        logger.addFilter(_NoTorchNotice())
