"""Implementations behind `moe_jax.ops.grouped_matmul`; pick one by name there.

Each backend is `fn(x [M, H], w [E, O, H], group_sizes [E] int32) -> [M, O]`,
receives already-validated arguments, and returns zeros for the padding rows
past sum(group_sizes).
"""
