"""moe_jax parameters <-> an orbax checkpoint, restorable onto any device layout.

    save_orbax_params(model.params, "ckpt/", config=hf_config)       # from any layout
    params = restore_orbax_params("ckpt/", other_model)              # straight into other_model's shardings
    config = read_orbax_config("ckpt/")

On disk:

    ckpt/config.json   the HF config (says which model the parameters belong to, and their dtype)
    ckpt/params/       an orbax `StandardCheckpointHandler` checkpoint of the parameters

The parameters are stored as a NESTED tree: `model.layers.0.mlp.gate.weight` is
`{"model": {"layers": {"0": {"mlp": {"gate": {"weight": ...}}}}}}`. Orbax names each stored array by its
tree path joined with dots, so the array names inside the checkpoint are exactly the HF names; a flat dict
with dotted keys would get the same storage names as the nested tree and collide with it, so it is not used.

Saving is atomic for the whole directory: orbax writes `params/` through its own temporary directory
(`params.orbax-checkpoint-tmp`, renamed when complete), inside a hidden staging directory beside `ckpt/` that
also receives `config.json` and is renamed to `ckpt/` at the end. On any error the staging directory is
removed and `ckpt/` is left as it was (absent or empty).

Restoring reads the stored shapes from orbax's metadata first and refuses any difference from the model's
declared parameters, then asks orbax for every array with the model's `NamedSharding`: each device reads
only its own slices, whatever layout saved them.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from etils import epath

from .errors import CheckpointMismatchError
from .multihost import barrier, is_writer, raise_everywhere, share_text
from .publish import destination_problem, publish, staging_directory

CONFIG_FILE_NAME = "config.json"
PARAMS_DIR_NAME = "params"
NAME_SEPARATOR = "."


def save_orbax_params(params: Mapping[str, jax.Array], directory: str | os.PathLike, *, config: dict) -> Path:
    """Write `params` (flat `{HF name: array}`, any sharding) and `config` as an orbax checkpoint.

    Args:
        params: the model's parameters, e.g. `model.params`.
        directory: the checkpoint directory to create; it must be absent or an empty directory.
        config: the HF model config (JSON-serialisable, with a `model_type`), written to `config.json`.

    Returns:
        `directory` as an absolute Path.
    """
    directory = Path(directory).absolute()
    config_text = _config_text(config)
    tree = nest_names(params)
    refusal = share_text(destination_problem(directory) if is_writer() else None)
    if refusal is not None:
        raise FileExistsError(refusal)

    # Every process writes its own shards through orbax into the staging directory process 0 made.
    staging = Path(share_text(str(staging_directory(directory)) if is_writer() else None))
    try:
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
            checkpointer.save(epath.Path(staging / PARAMS_DIR_NAME), args=ocp.args.StandardSave(tree))
        failure = None
        if is_writer():
            try:
                _write_config(staging, config_text)
                publish(staging, directory)
            except Exception as error:  # noqa: BLE001 (raised below on every process)
                failure = error
        raise_everywhere(failure, str(directory))
    except BaseException:
        if is_writer():
            shutil.rmtree(staging, ignore_errors=True)
        raise
    barrier("moe_jax.save_orbax_params")
    return directory


def read_orbax_config(directory: str | os.PathLike) -> dict:
    """The HF config stored beside the parameters of a checkpoint written by `save_orbax_params`."""
    path = Path(directory) / CONFIG_FILE_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"No {CONFIG_FILE_NAME} in {directory}: it is not an orbax parameter checkpoint written by "
            "moe_jax (save_orbax_params or `moe-jax convert --to orbax`), which holds config.json and params/."
        )
    return json.loads(path.read_text(encoding="utf-8"))


def restore_orbax_params(directory: str | os.PathLike, model) -> dict[str, jax.Array]:
    """Every parameter of `model`, read from `directory` directly into `model.named_shardings()`.

    The layout that saved the checkpoint does not matter. Arrays are cast to `model.param_dtype(name)` (the
    model's dtype; float32 for buffers) when stored in another dtype. Strict: raises `CheckpointMismatchError` naming every missing, unexpected or wrongly shaped
    parameter before anything is read.

    Returns:
        `{HF name: jax.Array}` in the order of the model's declared parameters (ready for `model.set_params`).
    """
    directory = Path(directory).absolute()
    if model.mesh is None:
        raise ValueError(
            f"{type(model).__name__} was built with abstract=True (no mesh), so it has no devices to restore "
            "onto. Build it with a DistributedConfig and devices instead."
        )
    config = read_orbax_config(directory)
    if config.get("model_type") != model.model_type:
        raise ValueError(
            f"{directory} holds a model_type={config.get('model_type')!r} checkpoint, but the model is "
            f"{type(model).__name__} (model_type={model.model_type!r}). Build the model from "
            "read_orbax_config(directory)."
        )
    params_dir = epath.Path(directory / PARAMS_DIR_NAME)
    if not params_dir.is_dir():
        raise FileNotFoundError(f"No {PARAMS_DIR_NAME}/ in {directory}: the orbax parameter checkpoint is incomplete.")

    declared = {name: tuple(spec.shape) for name, spec in model.module_tree.named_parameters()}
    _check_stored_shapes(directory, stored_shapes(params_dir), declared)
    shardings = model.named_shardings()
    target = nest_names({
        name: jax.ShapeDtypeStruct(shape, model.param_dtype(name), sharding=shardings[name])
        for name, shape in declared.items()
    })
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        restored = flatten_names(checkpointer.restore(params_dir, args=ocp.args.StandardRestore(target)))
    return {name: restored[name] for name in declared}


def stored_shapes(params_dir: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """`{HF name: shape}` of every array in an orbax parameter checkpoint, from its metadata (no data read)."""
    metadata = ocp.StandardCheckpointHandler().metadata(epath.Path(params_dir))
    return {name: tuple(leaf.shape) for name, leaf in flatten_names(metadata.tree).items()}


def nest_names(flat: Mapping[str, object]) -> dict:
    """{"a.b.c": x} -> {"a": {"b": {"c": x}}}; refuses names orbax could not store apart."""
    nested: dict = {}
    for name, value in flat.items():
        parts = name.split(NAME_SEPARATOR)
        if not all(parts):
            raise ValueError(f"Parameter name {name!r} has an empty part between dots; orbax cannot store it.")
        node = nested
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = NAME_SEPARATOR.join(parts[: depth + 1])
                raise ValueError(f"Parameter {prefix!r} is also the parent of {name!r}; names must form a tree.")
            node = child
        if parts[-1] in node:
            raise ValueError(f"Parameter {name!r} is also the parent of other parameters; names must form a tree.")
        node[parts[-1]] = value
    return nested


def flatten_names(nested: Mapping, prefix: str = "") -> dict:
    """{"a": {"b": {"c": x}}} -> {"a.b.c": x} (the inverse of `nest_names`)."""
    flat = {}
    for key, value in nested.items():
        name = f"{prefix}{NAME_SEPARATOR}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_names(value, name))
        else:
            flat[name] = value
    return flat


def _check_stored_shapes(directory: Path, stored: dict[str, tuple], declared: dict[str, tuple]) -> None:
    mismatch = CheckpointMismatchError(
        str(directory),
        missing=sorted(declared.keys() - stored.keys()),
        unexpected=sorted(stored.keys() - declared.keys()),
        duplicated=[],
        shape_mismatches=[
            f"{name}: checkpoint {stored[name]} != declared {declared[name]}"
            for name in sorted(declared.keys() & stored.keys()) if stored[name] != declared[name]
        ],
        dtype_mismatches=[],
    )
    if mismatch.has_problems:
        raise mismatch


def _config_text(config: dict) -> str:
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(
            "`config` must be the HF config dict with a 'model_type' (e.g. model.config.to_dict()), so the "
            "checkpoint says which model it holds."
        )
    try:
        return json.dumps(config, indent=2, sort_keys=True) + "\n"
    except TypeError as error:
        raise TypeError(f"`config` must be JSON-serialisable (a dict of plain values): {error}.") from None


def _write_config(staging: Path, config_text: str) -> None:
    (staging / CONFIG_FILE_NAME).write_text(config_text, encoding="utf-8")
