"""Tests run on 8 virtual CPU devices, set before JAX initialises."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
# Parity tests compare against fp32 references: keep XLA:CPU matmuls at full precision.
jax.config.update("jax_default_matmul_precision", "highest")
