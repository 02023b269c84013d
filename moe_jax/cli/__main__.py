"""`python -m moe_jax.cli ...`: the `moe-jax` command without the installed script (what `moe-jax launch`
starts in each process, and what tests and scripts run in a subprocess)."""

from . import entry

entry()
