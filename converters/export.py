"""moe_jax parameters -> a Hugging Face checkpoint in hub layout, one parameter in host memory at a time.

    save_params(params, "qwen3_moe", "out/my-model", config=hf_config_dict)
    out/my-model/  model-00001-of-00003.safetensors ... model.safetensors.index.json config.json

Fused expert parameters are written back per expert (`experts.gate_up_proj [E, 2I, H]` ->
`experts.{j}.gate_proj.weight [I, H]` + `experts.{j}.up_proj.weight [I, H]`), by running the key map's
rules backwards, so loading and exporting can never disagree. The bytes are the parameter's bytes: a
load -> save round trip reproduces every hub tensor bit for bit.

In a multi-process job every process calls this with its part of the parameters: each tensor is gathered
(a collective) and process 0 alone writes the files.

Everything is written into a hidden temporary directory beside `out_dir` and renamed into place at the
end; on any error the temporary directory is removed and `out_dir` is left as it was (absent or empty).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from .key_maps import KeyMap, key_map_for
from .multihost import barrier, gather_to_host, is_writer, raise_everywhere, share_text
from .publish import destination_problem, publish, staging_directory
from .shard_writer import ShardedCheckpointWriter, TensorEntry

CONFIG_FILE_NAME = "config.json"


def save_params(
    params: Mapping[str, jax.Array],
    key_map: KeyMap | str,
    out_dir: str | os.PathLike,
    *,
    config: dict,
    max_shard_bytes: int = 5 * 2**30,
    progress: bool = True,
) -> Path:
    """Write `params` as a safetensors checkpoint in hub layout into `out_dir` (which must not hold files).

    Args:
        params: `{dotted name: jax.Array}` (numpy arrays work too), in the order the files should list them.
        key_map: the architecture's `KeyMap`, or its name in `KEY_MAPS`.
        out_dir: the checkpoint directory to create; an existing empty directory is replaced.
        config: the HF model config as a dict, written to `config.json` (JSON-serialisable).
        max_shard_bytes: largest shard file size (a single larger tensor gets its own shard).
        progress: show a tqdm bar over parameters.

    Returns:
        `out_dir` as a Path.
    """
    key_map = key_map_for(key_map)
    out_dir = Path(out_dir)
    try:
        config_text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    except TypeError as error:
        raise TypeError(f"`config` must be JSON-serialisable (a dict of plain values): {error}.") from None
    entries = _plan_hub_tensors(params, key_map)
    refusal = share_text(destination_problem(out_dir) if is_writer() else None)
    if refusal is not None:
        raise FileExistsError(refusal)

    # Every process gathers every tensor (a collective); process 0 writes. A write error on process 0 is
    # kept until the gathers are done and then raised everywhere, so no process waits for a missing peer.
    staging, writer, failure = None, None, None
    try:
        if is_writer():
            staging = staging_directory(out_dir)
            writer = ShardedCheckpointWriter(staging, entries, max_shard_bytes)
        for name in tqdm(params, desc="Saving parameters", unit="param", disable=not (progress and is_writer())):
            host_array = gather_to_host(params[name])
            if writer is not None and failure is None:
                try:
                    for key, value in key_map.to_hub(name, host_array):
                        writer.write(key, value)
                except Exception as error:  # noqa: BLE001 (re-raised below on every process)
                    failure = error
            del host_array  # drop the gathered copy before the next parameter is fetched
        if writer is not None and failure is None:
            try:
                writer.finish()
                (staging / CONFIG_FILE_NAME).write_text(config_text, encoding="utf-8")
                publish(staging, out_dir)
            except Exception as error:  # noqa: BLE001
                failure = error
        raise_everywhere(failure, str(out_dir))
    except BaseException:
        if writer is not None:
            writer.abort()
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    barrier("moe_jax.save_params")
    return out_dir


def _plan_hub_tensors(params: Mapping[str, jax.Array], key_map: KeyMap) -> list[TensorEntry]:
    """Every hub tensor's key, shape and dtype, worked out before anything is gathered or written.

    The key map runs on zero-stride stand-ins of each parameter (`np.broadcast_to` of one element), so the
    export rules themselves give the hub shapes without allocating the parameters.
    """
    entries: list[TensorEntry] = []
    written_by: dict[str, str] = {}
    for name, array in params.items():
        stand_in = np.broadcast_to(np.zeros((), np.dtype(array.dtype)), tuple(array.shape))
        for key, value in key_map.to_hub(name, stand_in):
            if key in written_by:
                raise ValueError(
                    f"Hub key {key!r} would be written for both {written_by[key]} and {name}; "
                    "the parameters hold the same tensor in two layouts. Keep one."
                )
            written_by[key] = name
            entries.append(TensorEntry(key, tuple(value.shape), np.dtype(value.dtype)))
    return entries
