"""Validated, sliced, counted reads of safetensors files (numpy-written files; no torch)."""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from converters.errors import CheckpointFormatError
from converters.safetensors_io import SafetensorsCheckpoint, read_header, read_request, record_reads

from .tiny_checkpoints import BFLOAT16, same_bits, write_checkpoint


@pytest.fixture
def two_tensor_file(tmp_path):
    values = {"a": np.arange(24, dtype=np.float32).reshape(2, 3, 4), "b": np.arange(6, dtype=np.int64)}
    save_file(values, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path, values


def test_bfloat16_reads_as_ml_dtypes_bfloat16_bit_for_bit(tmp_path):
    """safetensors' numpy backend builds bfloat16 arrays once ml_dtypes is imported (converters does)."""
    values = np.random.default_rng(0).standard_normal((4, 6)).astype(ml_dtypes.bfloat16)
    write_checkpoint(tmp_path, {"w": values})
    with SafetensorsCheckpoint(tmp_path) as checkpoint:
        assert checkpoint.tensors["w"].dtype == BFLOAT16
        whole = checkpoint.read("w")
        block = checkpoint.read("w", (slice(1, 3), slice(2, 5)))
    assert same_bits(whole, values)
    assert same_bits(block, np.ascontiguousarray(values[1:3, 2:5]))


def test_reads_only_the_requested_block_and_counts_its_bytes(two_tensor_file):
    directory, values = two_tensor_file
    with SafetensorsCheckpoint(directory) as checkpoint, record_reads() as reads:
        with read_request("device 3"):
            block = checkpoint.read("a", (slice(1, 2), slice(0, 3), slice(1, 3)))
        np.testing.assert_array_equal(block, values["a"][1:2, :, 1:3])
        assert checkpoint.bytes_read == 1 * 3 * 2 * 4
        scalar_rest = checkpoint.read("b", (slice(4, None),))
        np.testing.assert_array_equal(scalar_rest, [4, 5])
    assert [(r.key, r.index, r.nbytes, r.request) for r in reads] == [
        ("a", ((1, 2), (0, 3), (1, 3)), 24, "device 3"),
        ("b", ((4, 6),), 16, None),
    ]


def test_header_gives_shapes_dtypes_and_files_without_reading_data(tmp_path):
    write_checkpoint(tmp_path, {"x": np.zeros((5, 7), np.float16), "y": np.zeros((0, 3), np.float32)})
    header = read_header(tmp_path / "model.safetensors")
    assert {k: (v.shape, str(v.dtype), v.nbytes) for k, v in header.items()} == {
        "x": ((5, 7), "float16", 70), "y": ((0, 3), "float32", 0)
    }
    with SafetensorsCheckpoint(tmp_path) as checkpoint:
        assert checkpoint.read("y").shape == (0, 3)  # empty tensors need no bytes (safetensors rejects the slice)
        assert checkpoint.bytes_read == 0


def corrupt(path, transform):
    path.write_bytes(transform(path.read_bytes()))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda data: data[:-7], r"truncated \(re-download"),
        (lambda data: data[:5], "shorter than the 8-byte header length prefix"),
        (lambda data: data[:40], "only .* follow it; the file is truncated"),
        (lambda data: data[:8] + b"[" + data[9:], "not valid UTF-8 JSON"),
        (lambda data: (10**12).to_bytes(8, "little") + data[8:], "corrupt header"),
        (lambda data: data.replace(b'"F32"', b'"Q32"'), "Unsupported safetensors dtype 'Q32'"),
        (lambda data: data.replace(b"[2,3,4]", b"[2,3,5]"), r"needs 120 bytes but its data_offsets span 96"),
        (lambda data: data + b"\0" * 8, "8 bytes after the last tensor"),
    ],
    ids=["truncated-data", "tiny-file", "truncated-header", "bad-json", "huge-length", "bad-dtype",
         "offsets-vs-shape", "trailing-bytes"],
)
def test_bad_files_name_the_file_and_the_fault(two_tensor_file, damage, message):
    directory, _ = two_tensor_file
    corrupt(directory / "model.safetensors", damage)
    with pytest.raises(CheckpointFormatError, match=message) as error:
        SafetensorsCheckpoint(directory)
    assert str(directory / "model.safetensors") in str(error.value)


def test_a_tensor_listed_twice_in_one_header_is_refused(two_tensor_file):
    directory, _ = two_tensor_file
    path = directory / "model.safetensors"
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + size].decode()
    duplicated = header.replace('"b":', '"a":', 1)  # same length, so offsets stay valid
    path.write_bytes(data[:8] + duplicated.encode() + data[8 + size :])
    with pytest.raises(CheckpointFormatError, match="lists tensor 'a' twice"):
        SafetensorsCheckpoint(directory)


def test_safetensors_errors_after_opening_are_wrapped_with_the_file(two_tensor_file):
    directory, _ = two_tensor_file
    with SafetensorsCheckpoint(directory) as checkpoint:
        corrupt(directory / "model.safetensors", lambda data: data[:-30])  # damaged after the headers were read
        with pytest.raises(CheckpointFormatError, match=r"safetensors cannot open .*model.safetensors.*truncated"):
            checkpoint.read("a")


def sharded(tmp_path):
    tensors = {f"t{i}": np.full((16,), i, np.float32) for i in range(4)}
    return write_checkpoint(tmp_path, tensors, max_shard_bytes=128), tensors


def edit_index(directory, change):
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    change(index["weight_map"])
    path.write_text(json.dumps(index))


def test_sharded_checkpoint_reads_every_shard(tmp_path):
    directory, tensors = sharded(tmp_path)
    with SafetensorsCheckpoint(directory) as checkpoint:
        assert len(checkpoint.files) == 2
        for key, value in tensors.items():
            np.testing.assert_array_equal(checkpoint.read(key), value)


@pytest.mark.parametrize("bad_name", ["../model-00001-of-00002.safetensors", "/etc/passwd", "sub/x.safetensors",
                                      "..\\x.safetensors", ".."])
def test_index_names_outside_the_directory_are_refused_naming_the_entry(tmp_path, bad_name):
    directory, _ = sharded(tmp_path / "ckpt")
    edit_index(directory, lambda weight_map: weight_map.update(t2=bad_name))
    with pytest.raises(CheckpointFormatError, match="entry 't2' names shard file .*not a plain file name"):
        SafetensorsCheckpoint(directory)


def test_missing_shard_is_named(tmp_path):
    directory, _ = sharded(tmp_path)
    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointFormatError, match="names shard file 'model-00002-of-00002.safetensors'.*does not exist"):
        SafetensorsCheckpoint(directory)


def test_index_and_shards_must_agree(tmp_path):
    directory, _ = sharded(tmp_path)
    edit_index(directory, lambda weight_map: weight_map.update(ghost="model-00001-of-00002.safetensors"))
    with pytest.raises(CheckpointFormatError, match="'ghost' is listed in the index .* but no shard holds it"):
        SafetensorsCheckpoint(directory)
    edit_index(directory, lambda weight_map: (weight_map.pop("ghost"), weight_map.pop("t3")))
    with pytest.raises(CheckpointFormatError, match="'t3' is stored in 'model-00002-of-00002.safetensors' but missing"):
        SafetensorsCheckpoint(directory)


def test_directory_needs_exactly_one_checkpoint_layout(tmp_path):
    with pytest.raises(FileNotFoundError, match="expected model.safetensors or model.safetensors.index.json"):
        SafetensorsCheckpoint(tmp_path)
    directory, _ = sharded(tmp_path)
    write_checkpoint(directory, {"x": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointFormatError, match="holds both"):
        SafetensorsCheckpoint(directory)
