"""Writing a sharded safetensors checkpoint one tensor at a time.

safetensors puts a header with every tensor's offsets before the data, so the layout is planned first from
shapes and dtypes alone (`plan_shards`), then tensors are streamed into the files in plan order: only the
tensor being written has to exist in memory.

    file:  [8-byte little-endian header length][JSON header, space-padded to 8 bytes][tensor bytes ...]

Shards follow `save_pretrained`: `model.safetensors` when everything fits in one, else
`model-00001-of-0000n.safetensors` ... plus `model.safetensors.index.json`. A shard is closed when the next
tensor would take it over `max_shard_bytes`; a tensor larger than that gets a shard of its own.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .dtypes import safetensors_dtype
from .safetensors_io import INDEX_FILE_NAME, METADATA_KEY, SINGLE_FILE_NAME

# transformers refuses safetensors files whose metadata lacks a known framework.
FILE_METADATA = {"format": "pt"}


@dataclass(frozen=True)
class TensorEntry:
    key: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def plan_shards(entries: list[TensorEntry], max_shard_bytes: int) -> list[list[TensorEntry]]:
    """Consecutive entries grouped into shards of at most `max_shard_bytes` (bar single oversized tensors)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}.")
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def shard_file_names(num_shards: int) -> list[str]:
    if num_shards == 1:
        return [SINGLE_FILE_NAME]
    return [f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)]


def header_bytes(entries: list[TensorEntry], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header of a file holding `entries` back to back, in order."""
    header: dict[str, object] = {METADATA_KEY: metadata}
    offset = 0
    for entry in entries:
        header[entry.key] = {
            "dtype": safetensors_dtype(entry.dtype),
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # keeps tensor data 8-byte aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text


class SafetensorsFileWriter:
    """One safetensors file: header written on open, then `write` each entry in order, then `close`."""

    def __init__(self, path: Path, entries: list[TensorEntry], metadata: dict[str, str] = FILE_METADATA):
        self.path, self.entries, self._next = Path(path), entries, 0
        self._file = open(self.path, "xb")
        self._file.write(header_bytes(entries, metadata))

    def write(self, key: str, array: np.ndarray) -> None:
        if self._next >= len(self.entries):
            raise ValueError(f"{self.path.name} is complete; {key!r} does not belong to it.")
        entry = self.entries[self._next]
        if (key, tuple(array.shape), np.dtype(array.dtype)) != (entry.key, entry.shape, np.dtype(entry.dtype)):
            raise ValueError(
                f"Expected {entry.key!r} {list(entry.shape)} {entry.dtype} next in {self.path.name}, got "
                f"{key!r} {list(array.shape)} {array.dtype}."
            )
        contiguous = np.ascontiguousarray(array)
        # Write through a byte view: no second copy of a large tensor (tobytes() would make one).
        self._file.write(memoryview(contiguous.reshape(-1).view(np.uint8)))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.entries):
            raise ValueError(
                f"{self.path.name} was closed after {self._next} of {len(self.entries)} tensors; "
                f"{self.entries[self._next].key!r} was never written."
            )
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        self._file.close()


class ShardedCheckpointWriter:
    """Streams tensors, in the planned order, into consecutive shard files of `directory`."""

    def __init__(self, directory: Path, entries: list[TensorEntry], max_shard_bytes: int):
        self.directory = Path(directory)
        self.shards = plan_shards(entries, max_shard_bytes)
        self.file_names = shard_file_names(len(self.shards))
        self._shard = -1
        self._writer: SafetensorsFileWriter | None = None
        self._written_in_shard = 0

    def write(self, key: str, array: np.ndarray) -> None:
        if self._writer is None or self._written_in_shard == len(self.shards[self._shard]):
            self._next_file()
        self._writer.write(key, array)
        self._written_in_shard += 1

    def _next_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._shard += 1
        if self._shard >= len(self.shards):
            raise ValueError("More tensors written than planned.")
        path = self.directory / self.file_names[self._shard]
        self._writer = SafetensorsFileWriter(path, self.shards[self._shard])
        self._written_in_shard = 0

    def finish(self) -> list[Path]:
        """Close the last shard, check every planned tensor arrived, write the index when sharded."""
        # Shards with nothing written yet (an empty plan) still get their header-only file.
        while self._shard < len(self.shards) - 1 or self._writer is None:
            self._next_file()
        self._writer.close()
        self._writer = None
        paths = [self.directory / name for name in self.file_names]
        if len(self.shards) > 1:
            weight_map = {
                entry.key: name for name, shard in zip(self.file_names, self.shards) for entry in shard
            }
            total_size = sum(entry.nbytes for shard in self.shards for entry in shard)
            total_parameters = sum(math.prod(entry.shape) for shard in self.shards for entry in shard)
            index = {
                "metadata": {"total_size": total_size, "total_parameters": total_parameters},
                "weight_map": dict(sorted(weight_map.items())),
            }
            index_path = self.directory / INDEX_FILE_NAME
            index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
            paths.append(index_path)
        return paths

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
