"""Which collectives a jitted program runs, and in which dtypes, as the SPMD partitioner emitted them.

    compiled, counts = compile_with_collectives(jax.jit(step).lower(state, batch))
    counts[("all-reduce", "bf16")]        # cross-device sums in bfloat16

The compiled program's own HLO is no help for dtypes on CPU: the CPU backend runs bfloat16 arithmetic in
float32 and rewrites the collectives to match. The partitioner's output, before any backend pass, shows
the dtype the program asks for on every backend, so this check means the same on CPU and GPU.
"""

from __future__ import annotations

import collections
import re
import tempfile
from pathlib import Path

import jax

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
REDUCTIONS = ("all-reduce", "reduce-scatter")
# `%name = bf16[24,32]{1,0} all-reduce(...` (also the tuple-free start/done forms' plain op names).
_INSTRUCTION = re.compile(r"=\s+(?P<dtype>[a-z]+[0-9]*)\[[^\]]*\](?:\{[^}]*\})?\s+(?P<op>[a-z-]+)\(")
_AFTER_PARTITIONING = "*after_spmd-partitioning*"


def count_collectives(hlo_text: str) -> collections.Counter:
    """(op, dtype) -> count of the array-valued collectives in an HLO module's text."""
    counts: collections.Counter = collections.Counter()
    for match in _INSTRUCTION.finditer(hlo_text):
        if match["op"] in COLLECTIVES:
            counts[(match["op"], match["dtype"])] += 1
    return counts


def compile_with_collectives(lowered) -> tuple[object, collections.Counter]:
    """(the compiled program, its collectives after SPMD partitioning) for a `jax.jit(...).lower(...)`.

    The program compiles once, with XLA dumping the partitioner's output to a temporary directory. A program
    taken from JAX's persistent compilation cache runs no XLA pass, so there is nothing to read: that is
    an error naming the cache (the cache keeps its setting for the whole process once used)."""
    with tempfile.TemporaryDirectory() as directory:
        compiled = lowered.compile(compiler_options={
            "xla_dump_to": directory,
            "xla_dump_hlo_pass_re": "spmd-partitioning",
        })
        return compiled, _partitioned_counts(Path(directory))


def _partitioned_counts(directory: Path) -> collections.Counter:
    dumps = sorted(directory.glob(_AFTER_PARTITIONING))
    if not dumps:
        cache = jax.config.jax_compilation_cache_dir
        raise RuntimeError(
            "XLA wrote no HLO after spmd-partitioning: "
            + (f"the program probably came from the persistent compilation cache ({cache}); run without "
               "JAX_COMPILATION_CACHE_DIR, or on a program not compiled before." if cache else
               "a program over one device is not partitioned, or the pass has another name in this XLA version.")
        )
    counts: collections.Counter = collections.Counter()
    for dump in dumps:
        counts += count_collectives(dump.read_text())
    return counts
