"""The import layers of moe_jax and converters: a module imports from its own layer and the layers
below it, never from a layer above, nor from another layer of the same rank.

Every module is read with `ast`, not imported (no JAX): every `import` and `from ... import`, the ones inside
functions and under `TYPE_CHECKING` included (a lazy import is still a dependency), relative ones resolved.

    rank 0  leaf         small modules that import nothing from moe_jax or converters
    rank 1  ops          array ops: routing, permute, grouped matmul, accumulation, experts math
    rank 2  distributed  DistributedConfig, mesh, plans, styles, sharding, capacity, the EP layer, runtime
    rank 3  kv_cache     the KV cache: the cache pytrees, each layer's view, making / placing, the page book
    rank 4  nn           layers: linear, attention, norms, rotary, mlp, moe, precision
    rank 5  models       the model core: families (data + free functions), decoder, step, layer stack
    rank 6  converters | inference | training | lora   (siblings: none of the four imports another)
    rank 7  facade       causal_lm (the HF-shaped model classes, auto), pretrained, nnx, reporting, serving,
                         __init__
    rank 8  entry        the command line and its jobs
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moe_jax", "converters")

RANK = {"leaf": 0, "ops": 1, "distributed": 2, "kv_cache": 3, "nn": 4, "models": 5,
        "converters": 6, "inference": 6, "training": 6, "lora": 6, "facade": 7, "entry": 8}

# Path prefix -> layer; the longest matching prefix wins. A directory ends with "/". Top-level modules are
# listed one by one, so a new one (or a new subpackage) fails `test_every_module_has_a_layer` until placed.
LAYER_OF_PATH = {
    # Leaves: imported from many layers (module_tree by distributed's plans and sharding and by converters,
    # checkpoint_files by causal_lm/auto.py, tokenization by training/data.py), importing nothing themselves.
    "moe_jax/checkpoint_files.py": "leaf",
    "moe_jax/module_tree.py": "leaf",
    "moe_jax/parameter_dtypes.py": "leaf",
    "moe_jax/host_memory.py": "leaf",
    "moe_jax/host_devices.py": "leaf",   # virtual CPU devices, for the demo, the layout flags and scripts
    "moe_jax/verbosity.py": "leaf",
    "moe_jax/tokenization.py": "leaf",
    "moe_jax/chat_template.py": "leaf",   # by tokenization.py: chat templates without Transformers
    "moe_jax/compilation_cache.py": "leaf",
    "moe_jax/speculative_limits.py": "leaf",   # speculative decoding's settings, read by the flags before JAX   # JAX's persistent compilation cache, for commands that start often
    "moe_jax/ops/": "ops",
    "moe_jax/distributed/": "distributed",
    "moe_jax/kv_cache/": "kv_cache",
    "moe_jax/nn/": "nn",
    "moe_jax/models/": "models",
    "converters/": "converters",
    "moe_jax/inference/": "inference",
    "moe_jax/training/": "training",
    "moe_jax/lora/": "lora",   # LoRA adapters: config, targets, layout, PEFT's files (the math: ops/lora.py)
    "moe_jax/__init__.py": "facade",
    "moe_jax/causal_lm/": "facade",
    "moe_jax/pretrained.py": "facade",
    "moe_jax/nnx/": "facade",
    "moe_jax/reporting/": "facade",
    "moe_jax/rl/": "facade",   # GRPO over the sampler (inference) and the train step (training)
    "moe_jax/serving/": "facade",   # the HTTP server over inference's manager (FastAPI, an optional extra)
    "moe_jax/planning/": "facade",  # which layout to use: compiles the real train step, so above training
    "moe_jax/target_compile/": "facade",  # the programs compiled for a GPU target (or this CPU) and read
    "moe_jax/cli/": "entry",  # the commands, the launcher, the demo
}

# Upward imports tolerated for now (none since the facade split); this list may only shrink (an
# entry that no longer occurs fails).
KNOWN_UPWARD_IMPORTS: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    path: str
    line: int
    imported: str  # absolute module name


def module_name(path: str) -> str:
    """`moe_jax/nn/linear.py` -> `moe_jax.nn.linear`; a package's `__init__.py` is the package."""
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_paths() -> dict[str, str]:
    """Every module of the checked packages: name -> repository-relative path."""
    paths = {}
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            path = file.relative_to(ROOT).as_posix()
            paths[module_name(path)] = path
    return paths


def layer_of_path(path: str) -> str | None:
    matches = [prefix for prefix in LAYER_OF_PATH
               if path == prefix or (prefix.endswith("/") and path.startswith(prefix))]
    return LAYER_OF_PATH[max(matches, key=len)] if matches else None


def layer_of_module(name: str, paths: dict[str, str]) -> str | None:
    """The layer of module `name`, or of its nearest enclosing module that exists (a stale import's name)."""
    while name:
        if name in paths:
            return layer_of_path(paths[name])
        name = name.rpartition(".")[0]
    return None


def imports_of(path: str, source: str, known: set[str]) -> list[Import]:
    """The moe_jax/converters modules `source` (the file at `path`) imports, resolved to absolute names:
    `from a.b import c` names `a.b.c` when that is a module, else `a.b`."""
    module = module_name(path)
    package = module if path.endswith("/__init__.py") else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin
                       for alias in node.names]
        else:
            continue
        found.extend(Import(module, path, node.lineno, target) for target in dict.fromkeys(targets)
                     if target.split(".")[0] in PACKAGES)
    return found


def may_import(importer: str, imported: str) -> bool:
    return importer == imported or RANK[imported] < RANK[importer]


def upward_imports(path: str, source: str, paths: dict[str, str]) -> list[tuple[Import, str, str]]:
    """(import, importer's layer, imported layer) for each import of `source` the layers forbid."""
    importer = layer_of_path(path)
    found = []
    for item in imports_of(path, source, set(paths)):
        imported = layer_of_module(item.imported, paths)
        if imported is not None and not may_import(importer, imported):
            found.append((item, importer, imported))
    return found


def describe(item: Import, importer: str, imported: str) -> str:
    return (f"{item.path}:{item.line}: {item.module} ({importer}, rank {RANK[importer]}) imports "
            f"{item.imported} ({imported}, rank {RANK[imported]})")


def all_upward_imports() -> list[tuple[Import, str, str]]:
    paths = module_paths()
    found = []
    for path in paths.values():
        found.extend(upward_imports(path, (ROOT / path).read_text(encoding="utf-8"), paths))
    return found


def test_every_module_has_a_layer():
    unplaced = sorted(path for path in module_paths().values() if layer_of_path(path) is None)
    assert not unplaced, f"modules without a layer (add them to LAYER_OF_PATH): {unplaced}"


def test_no_upward_imports():
    found = all_upward_imports()
    unexpected = [describe(*entry) for entry in found
                  if (entry[0].module, entry[0].imported) not in KNOWN_UPWARD_IMPORTS]
    assert not unexpected, "imports from a higher layer (or a sibling layer):\n" + "\n".join(unexpected)
    gone = KNOWN_UPWARD_IMPORTS - {(entry[0].module, entry[0].imported) for entry in found}
    assert not gone, f"no longer imported, remove from KNOWN_UPWARD_IMPORTS: {sorted(gone)}"


PLANTED = '''"""An op that reaches up, lazily."""

import jax

from . import routing


def f():
    from ..models import core
'''


def test_a_planted_upward_import_is_caught():
    paths = module_paths()
    found = upward_imports("moe_jax/ops/planted.py", PLANTED, paths)
    assert [describe(*entry) for entry in found] == [
        "moe_jax/ops/planted.py:9: moe_jax.ops.planted (ops, rank 1) imports moe_jax.models.core "
        "(models, rank 5)"
    ]
    sibling = upward_imports("moe_jax/training/planted.py", "import converters.key_maps\n", paths)
    assert [(item.imported, layer) for item, _, layer in sibling] == [("converters.key_maps", "converters")]


# What the facade's service packages may reach: `serving/` talks to the engine through the manager's interface
# only (with the host-side helpers the manager's outputs need: sampling bounds, incremental detokenizing, the
# grammars of structured output), never to models, training or the engine's programs; `reporting/` reads the
# distributed layer's plans and layouts.
ALLOWED_IMPORTS = {
    "moe_jax/serving/": ("moe_jax.serving", "moe_jax.inference.manager", "moe_jax.inference.sampling",
                         "moe_jax.inference.detokenize", "moe_jax.inference.grammar", "moe_jax.tokenization",
                         "moe_jax.chat_template"),
    # The plan report and layout picture read the plans; the layout ranking prints the planner's rows.
    "moe_jax/reporting/": ("moe_jax.reporting", "moe_jax.distributed", "moe_jax.planning"),
}


def test_serving_and_reporting_import_only_their_interfaces():
    paths = module_paths()
    outside = []
    for prefix, allowed in ALLOWED_IMPORTS.items():
        for path in (path for path in paths.values() if path.startswith(prefix)):
            outside += [f"{item.path}:{item.line}: {item.imported}"
                        for item in imports_of(path, (ROOT / path).read_text(encoding="utf-8"), set(paths))
                        if not any(item.imported == name or item.imported.startswith(name + ".")
                                   for name in allowed)]
    assert not outside, "imports outside the package's interface:\n" + "\n".join(outside)


def test_the_model_layers_pass_state_as_arguments_not_context_variables():
    """No `ContextVar` (or `contextvars`) below the facade: what a call needs (its capacity, its experts) is
    an argument, so a trace depends on nothing but its inputs."""
    found = [f"{path}:{number}" for path in module_paths().values()
             if path.startswith(("moe_jax/distributed/", "moe_jax/nn/", "moe_jax/models/", "moe_jax/ops/"))
             for number, line in enumerate((ROOT / path).read_text(encoding="utf-8").splitlines(), 1)
             if "ContextVar" in line or "contextvars" in line]
    assert not found, f"context variables in the model layers: {found}"
