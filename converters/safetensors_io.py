"""Reading Hugging Face safetensors checkpoints lazily, one device slice at a time.

A checkpoint directory holds either one `model.safetensors` or a `model.safetensors.index.json` whose
`weight_map` names the shard file of every key. Opening a checkpoint reads only the headers (shapes,
dtypes, byte offsets) and validates them; tensor bytes are read later, by `SafetensorsCheckpoint.read(key,
index)`, through safetensors' `get_slice` so that only the requested sub-block is pulled from the file.

Every read is counted (`SafetensorsCheckpoint.bytes_read`) and reported to the observers installed by
`record_reads()`, so tests can check that a device's parameter slice read only its own bytes:

    with record_reads() as reads:
        params = load_params(...)
    sum(read.nbytes for read in reads if read.key.startswith("model.layers.1.mlp.experts.3."))
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from .dtypes import numpy_dtype
from .errors import CheckpointFormatError

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"
# The safetensors format itself refuses headers above 100 MB; a larger length prefix means a corrupt file.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"

Index = tuple[slice, ...]
# Dtypes safetensors' numpy backend cannot build (it looks up `numpy.float8_e4m3fn`): read from a memory map of
# the tensor's bytes instead, whose offsets the validated header gives (FP8 hub weights).
MAPPED_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


@dataclass(frozen=True)
class TensorInfo:
    """Where one checkpoint tensor lives and what it is, from its file's header (no data read)."""

    key: str
    path: Path
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int = 0  # the file offset of the tensor's first byte

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class TensorRead:
    """One slice read from a checkpoint: `index` holds `(start, stop)` per dimension of tensor `key`.

    `request` is the label of the enclosing `read_request(...)` block (the loader uses
    `(parameter name, block bounds, ids of the devices that receive the block)`), or None outside one.
    """

    path: Path
    key: str
    index: tuple[tuple[int, int], ...]
    nbytes: int
    request: object | None


_read_observers: list[Callable[[TensorRead], None]] = []
_current_request: contextvars.ContextVar[object | None] = contextvars.ContextVar("read_request", default=None)


@contextlib.contextmanager
def record_reads() -> Iterator[list[TensorRead]]:
    """Collect every `TensorRead` made inside the block, in order."""
    reads: list[TensorRead] = []
    _read_observers.append(reads.append)
    try:
        yield reads
    finally:
        _read_observers.remove(reads.append)


@contextlib.contextmanager
def read_request(label: object) -> Iterator[None]:
    """Tag the reads made inside the block with `label` (see `TensorRead.request`)."""
    token = _current_request.set(label)
    try:
        yield
    finally:
        _current_request.reset(token)


# ----------------------------------------------------------------------------------------------- headers


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header: `{key: TensorInfo}` in header order.

    Checks what safetensors checks, but names the file and the fault: the length prefix, the JSON, every
    entry's dtype/shape/offsets, and that the data section is exactly covered (a shorter file is truncated).
    """
    path = Path(path)
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as file:
            prefix = file.read(8)
            if len(prefix) < 8:
                raise _format_error(
                    path, f"the file is {file_size} bytes, shorter than the 8-byte header length prefix"
                )
            header_size = int.from_bytes(prefix, "little")
            if header_size > MAX_HEADER_BYTES:
                raise _format_error(
                    path, f"the header length prefix says {header_size} bytes (over {MAX_HEADER_BYTES}); corrupt header"
                )
            if 8 + header_size > file_size:
                raise _format_error(
                    path,
                    f"the header length prefix says {header_size} bytes but only {file_size - 8} follow it; "
                    "the file is truncated",
                )
            header_bytes = file.read(header_size)
    except OSError as error:
        raise CheckpointFormatError(f"Cannot read checkpoint file {path}: {error}.") from error

    header = _parse_header_json(path, header_bytes)
    data_size = file_size - 8 - header_size
    tensors: dict[str, TensorInfo] = {}
    extents: list[tuple[int, int, str]] = []
    for key, entry in header.items():
        if key == METADATA_KEY:
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise _format_error(path, f"`{METADATA_KEY}` must map strings to strings, got {entry!r}")
            continue
        info, begin, end = _parse_entry(path, key, entry, 8 + header_size)
        tensors[key] = info
        extents.append((begin, end, key))
    _check_data_covered(path, extents, data_size)
    return tensors


def _parse_header_json(path: Path, header_bytes: bytes) -> dict:
    def refuse_duplicates(pairs):
        seen: dict = {}
        for key, value in pairs:
            if key in seen:
                raise _format_error(path, f"the header lists tensor {key!r} twice")
            seen[key] = value
        return seen

    try:
        header = json.loads(header_bytes.decode("utf-8"), object_pairs_hook=refuse_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _format_error(path, f"the header is not valid UTF-8 JSON ({error}); corrupt header") from None
    if not isinstance(header, dict):
        raise _format_error(path, f"the header is JSON {type(header).__name__}, not an object; corrupt header")
    return header


def _parse_entry(path: Path, key: str, entry, data_start: int) -> tuple[TensorInfo, int, int]:
    if not isinstance(entry, dict) or {"dtype", "shape", "data_offsets"} - set(entry):
        raise _format_error(path, f"tensor {key!r} has header entry {entry!r}; it needs dtype, shape, data_offsets")
    try:
        dtype = numpy_dtype(entry["dtype"])
    except ValueError as error:
        raise _format_error(path, f"tensor {key!r}: {error}") from None
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise _format_error(path, f"tensor {key!r} has shape {shape!r}; expected a list of non-negative ints")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _format_error(path, f"tensor {key!r} has data_offsets {offsets!r}; expected [begin, end], 0 <= begin <= end")
    begin, end = offsets
    info = TensorInfo(key, path, tuple(shape), dtype, data_start + begin)
    if end - begin != info.nbytes:
        raise _format_error(
            path,
            f"tensor {key!r} ({entry['dtype']} {shape}) needs {info.nbytes} bytes but its data_offsets span "
            f"{end - begin}; corrupt header",
        )
    return info, begin, end


def _check_data_covered(path: Path, extents: list[tuple[int, int, str]], data_size: int) -> None:
    """Tensors must tile the data section exactly, as safetensors requires."""
    position, previous = 0, None
    for begin, end, key in sorted(extents):
        if begin != position:
            what = "overlaps" if begin < position else "leaves a gap after"
            raise _format_error(path, f"tensor {key!r} (bytes {begin}..{end}) {what} tensor {previous!r}; corrupt header")
        position, previous = end, key
    if position > data_size:
        raise _format_error(
            path,
            f"the header places tensor data up to byte {position} but the file holds only {data_size} bytes of "
            "data; the file is truncated (re-download or re-export it)",
        )
    if position < data_size:
        raise _format_error(
            path, f"the file holds {data_size - position} bytes after the last tensor that the header does not describe"
        )


def _format_error(path: Path, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"Invalid safetensors file {path}: {problem}.")


# ------------------------------------------------------------------------------------------ directories


def checkpoint_shards(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The shard files of a checkpoint directory and, when sharded, the index's `weight_map`.

    Raises naming the entry for index file names that are not plain names inside `directory` (`..`,
    absolute paths, separators) and naming the file for shards the index lists but the directory lacks.
    """
    directory = Path(directory)
    single, index = directory / SINGLE_FILE_NAME, directory / INDEX_FILE_NAME
    if single.is_file() and index.is_file():
        raise CheckpointFormatError(
            f"{directory} holds both {SINGLE_FILE_NAME} and {INDEX_FILE_NAME}; it is unclear which is current. "
            "Remove the stale one."
        )
    if single.is_file():
        return [single], None
    if not index.is_file():
        raise FileNotFoundError(
            f"No safetensors checkpoint in {directory}: expected {SINGLE_FILE_NAME} or {INDEX_FILE_NAME}."
        )
    weight_map = _read_weight_map(index)
    shard_names = list(dict.fromkeys(weight_map.values()))
    for name in shard_names:
        if not (directory / name).is_file():
            keys = [key for key, file_name in weight_map.items() if file_name == name]
            raise CheckpointFormatError(
                f"{index} names shard file {name!r} (for {len(keys)} keys, e.g. {keys[0]!r}) but {directory / name} "
                "does not exist; download the missing shard or re-export the checkpoint."
            )
    return [directory / name for name in shard_names], weight_map


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        content = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointFormatError(f"Cannot read checkpoint index {index}: {error}.") from error
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointFormatError(f"Checkpoint index {index} has no `weight_map` object mapping keys to shard files.")
    for key, name in weight_map.items():
        if not _is_plain_file_name(name):
            raise CheckpointFormatError(
                f"Checkpoint index {index}: entry {key!r} names shard file {name!r}, which is not a plain file "
                f"name inside {index.parent} (no '..', absolute paths or path separators allowed); fix the index."
            )
    return weight_map


def _is_plain_file_name(name) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
        and not os.path.isabs(name)
    )


# ----------------------------------------------------------------------------------------------- reader


class SafetensorsCheckpoint:
    """A checkpoint directory opened for slice reads: `tensors` from the headers, bytes on demand.

    Use as a context manager (or call `close()`): shard files stay memory-mapped while it is open.
    `strip_prefix`: keys that start with it are known without it (a multimodal checkpoint's text model under
    `language_model.`); reads and their records use the stored key.
    """

    def __init__(self, directory: str | os.PathLike, strip_prefix: str = ""):
        self.directory = Path(directory)
        self.files, weight_map = checkpoint_shards(self.directory)
        self.tensors: dict[str, TensorInfo] = {}
        for path in self.files:
            for key, info in read_header(path).items():
                if key in self.tensors:
                    raise CheckpointFormatError(
                        f"Tensor {key!r} is stored twice, in {self.tensors[key].path} and in {path}; remove one."
                    )
                self.tensors[key] = info
        if weight_map is not None:
            _check_index_matches_headers(self.directory / INDEX_FILE_NAME, weight_map, self.tensors)
        if strip_prefix:
            self.tensors = {key.removeprefix(strip_prefix): info for key, info in self.tensors.items()}
        self.bytes_read = 0
        self._handles: dict[Path, object] = {}
        self._mapped: dict[Path, np.memmap] = {}
        self._open_files = contextlib.ExitStack()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._open_files.close()
        self._handles.clear()
        self._mapped.clear()

    def read(self, key: str, index: Index | None = None) -> np.ndarray:
        """Read tensor `key`, or only its block `index` (one step-1 slice per dimension)."""
        info = self.tensors[key]
        index = normalize_index(index, info.shape)
        block_shape = tuple(s.stop - s.start for s in index)
        if math.prod(block_shape) == 0:
            # safetensors rejects empty slices; an empty block needs no bytes.
            return np.empty(block_shape, info.dtype)
        try:
            if info.dtype in MAPPED_DTYPES:
                data = np.array(self._tensor_bytes(info).view(info.dtype).reshape(info.shape)[index])
            else:
                data = self._handle(info.path).get_slice(info.key)[index]
        except (SafetensorError, OSError) as error:
            raise CheckpointFormatError(f"Reading {key!r} {_index_text(index)} from {info.path} failed: {error}.") from error
        data = np.asarray(data)
        if data.dtype != info.dtype or data.shape != block_shape:
            raise CheckpointFormatError(
                f"Reading {key!r} from {info.path} gave {data.dtype} {list(data.shape)}, the header promised "
                f"{info.dtype} {list(block_shape)}."
            )
        self.bytes_read += data.nbytes
        record = TensorRead(
            info.path, info.key, tuple((s.start, s.stop) for s in index), data.nbytes, _current_request.get()
        )
        for observer in list(_read_observers):
            observer(record)
        return data

    def _tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes in its file, through one memory map per file (no bytes read yet)."""
        mapped = self._mapped.get(info.path)
        if mapped is None:
            mapped = self._mapped[info.path] = np.memmap(info.path, np.uint8, "r")
        return mapped[info.offset:info.offset + info.nbytes]

    def _handle(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = self._open_files.enter_context(safe_open(str(path), framework="numpy"))
            except SafetensorError as error:
                raise CheckpointFormatError(
                    f"safetensors cannot open {path}: {error}; the file is corrupt or truncated."
                ) from error
            self._handles[path] = handle
        return handle


def _check_index_matches_headers(index: Path, weight_map: dict[str, str], tensors: dict[str, TensorInfo]) -> None:
    """The index and the shards must agree key for key: a stale index hides or invents tensors."""
    problems = []
    for key, name in weight_map.items():
        if key not in tensors:
            problems.append(f"{key!r} is listed in the index under {name!r} but no shard holds it")
        elif tensors[key].path.name != name:
            problems.append(f"{key!r} is listed under {name!r} but stored in {tensors[key].path.name!r}")
    problems.extend(
        f"{key!r} is stored in {info.path.name!r} but missing from the index"
        for key, info in tensors.items()
        if key not in weight_map
    )
    if problems:
        raise CheckpointFormatError(
            f"Checkpoint index {index} does not match its shard files: " + "; ".join(problems) + ". Re-export it."
        )


def normalize_index(index: Index | None, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """`None`, `(slice(None),)*n` or partial slices -> one `slice(start, stop)` per dimension (step 1)."""
    if index is None:
        index = ()
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    if len(index) != len(shape):
        raise ValueError(f"Index {index} has more dimensions than shape {list(shape)}.")
    normalized = []
    for entry, size in zip(index, shape):
        if not isinstance(entry, slice):
            raise TypeError(f"Index entries must be slices, got {entry!r}.")
        start, stop, step = entry.indices(size)
        if step != 1:
            raise ValueError(f"Only step-1 slices can be read, got {entry}.")
        normalized.append(slice(start, max(start, stop)))
    return tuple(normalized)


def _index_text(index: tuple[slice, ...]) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in index) + "]"
