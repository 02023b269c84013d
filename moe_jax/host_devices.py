"""Virtual CPU devices: `use_cpu_devices(n)` asks XLA's CPU platform for `n` host devices.

A machine without accelerators then runs every layout (tp x fsdp x ep x pp) on `n` virtual devices, as the
demo, the tests and the scripts do. It must run before JAX starts its CPU backend (before the first
`jax.devices()`); importing this module imports no JAX.
"""

from __future__ import annotations

import os
import re

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_DEVICE_COUNT = re.compile(re.escape(DEVICE_COUNT_FLAG) + r"=\S*")


def use_cpu_devices(count: int = 8, *, override: bool = False) -> None:
    """Add `--xla_force_host_platform_device_count=count` to XLA_FLAGS (only the CPU platform reads it).

    A count already in XLA_FLAGS (the user's own) is kept unless `override`, which replaces it. Has no effect
    once JAX has started its CPU backend; the caller checks `jax.devices()` if it needs the count.
    """
    if count < 1:
        raise ValueError(f"use_cpu_devices needs a count >= 1, got {count}")
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_COUNT.search(flags):
        if not override:
            return
        flags = _DEVICE_COUNT.sub("", flags)
    os.environ["XLA_FLAGS"] = " ".join(f"{flags} {DEVICE_COUNT_FLAG}={count}".split())
