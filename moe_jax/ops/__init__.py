"""Pure array ops for mixture-of-experts layers: routing, permutation, grouped matmul, experts."""

from .experts import swiglu_experts
from .grouped_matmul import (
    GROUPED_MATMUL_BACKENDS,
    default_backend,
    grouped_matmul,
    register_grouped_matmul_backend,
)
from .permute import gather_rows, invert_permutation, sort_by_expert, unpermute
from .routing import load_balancing_loss, mixtral_top_k, softmax_top_k

__all__ = [
    "GROUPED_MATMUL_BACKENDS",
    "default_backend",
    "gather_rows",
    "grouped_matmul",
    "invert_permutation",
    "load_balancing_loss",
    "mixtral_top_k",
    "register_grouped_matmul_backend",
    "softmax_top_k",
    "sort_by_expert",
    "swiglu_experts",
    "unpermute",
]
