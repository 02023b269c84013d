"""Readable reports about a layout or a compiled program, for people and tests rather than for the step:
`picture` (which batch, TP position and experts each device holds: `moe-jax layout`), `plan_report` (merged
plans and every parameter's sharding: `moe-jax plan`, the demo) and `collectives_report` (which collectives
a jitted program runs, in which dtypes). They read `distributed/` and `models/`; nothing below them imports
them (they were in `distributed/`, which is about doing the sharding, not describing it). Nothing is
re-exported: each command or test imports the one report it prints.
"""
