"""Loading hub checkpoints into sharded moe_jax parameters: values, bytes read per device, strict errors."""

import json
import re
from collections import defaultdict

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from converters import CheckpointFormatError, CheckpointMismatchError, load_params, record_reads

from .tiny_checkpoints import (
    BFLOAT16,
    MIXTRAL_CONFIG,
    QWEN3_CONFIG,
    SPARSE_LAYER,
    mixtral_hub_tensors,
    mixtral_tree,
    qwen3_hub_tensors,
    qwen3_tree,
    random_params,
    read_checkpoint,
    same_bits,
    shardings_for,
    write_checkpoint,
)

GATE_UP = f"{SPARSE_LAYER}.mlp.experts.gate_up_proj"
DOWN = f"{SPARSE_LAYER}.mlp.experts.down_proj"
EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")


def assert_loaded(loaded, expected):
    assert list(loaded) == list(expected)
    for name, value in expected.items():
        assert same_bits(np.asarray(loaded[name]), value), name


def reads_by_request(reads, name):
    grouped = defaultdict(list)
    for read in reads:
        if read.request[0] == name:
            grouped[read.request[1]].append(read)
    return grouped


def test_sharded_hub_checkpoint_loads_fused_experts(tmp_path):
    tree = qwen3_tree()
    params = random_params(tree)
    write_checkpoint(tmp_path, qwen3_hub_tensors(params), max_shard_bytes=16_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert_loaded(load_params(tmp_path, tree, "qwen3_moe", progress=False), params)


def test_fused_layout_checkpoint_loads_too_even_mixed_per_layer(tmp_path):
    tree = qwen3_tree(num_hidden_layers=3)  # layers 1 and 2 are sparse
    params = random_params(tree)
    hub = qwen3_hub_tensors({k: v for k, v in params.items() if not k.startswith("model.layers.2.")})
    hub.update({k: v for k, v in params.items() if k.startswith("model.layers.2.")})  # layer 2 stays fused
    write_checkpoint(tmp_path, hub)
    assert "model.layers.2.mlp.experts.gate_up_proj" in hub and "model.layers.1.mlp.experts.0.up_proj.weight" in hub
    assert_loaded(load_params(tmp_path, tree, "qwen3_moe", progress=True), params)


def test_mixtral_hub_names_load(tmp_path):
    tree = mixtral_tree()
    params = random_params(tree)
    write_checkpoint(tmp_path, mixtral_hub_tensors(params))
    assert_loaded(load_params(tmp_path, tree, "mixtral", progress=False), params)


def test_ep8_each_device_reads_only_its_experts_bytes(tmp_path):
    tree, shardings = shardings_for(8, fsdp_size=8, ep_size=8)
    params = random_params(tree)
    write_checkpoint(tmp_path, qwen3_hub_tensors(params), max_shard_bytes=16_000)
    with record_reads() as reads:
        loaded = load_params(tmp_path, tree, "qwen3_moe", shardings, progress=False)

    for name in (GATE_UP, DOWN):
        assert shardings[name].spec == P("ep_fsdp", None, None)
        requests = reads_by_request(reads, name)
        assert len(requests) == 8  # one block per device
        for bounds, block_reads in requests.items():
            expert = bounds[0][0]
            assert bounds[0] == (expert, expert + 1)
            assert {int(EXPERT_KEY.search(read.key).group(1)) for read in block_reads} == {expert}
            assert sum(read.nbytes for read in block_reads) == params[name].nbytes // 8
        for shard in loaded[name].addressable_shards:
            assert same_bits(np.asarray(shard.data), params[name][shard.index])
    # Every parameter is split 8 ways, so the whole load reads each checkpoint byte exactly once.
    assert sum(read.nbytes for read in reads) == sum(value.nbytes for value in params.values())
    assert_loaded(loaded, params)


def test_tp2_gate_up_rows_read_gate_or_up_only(tmp_path):
    tree, shardings = shardings_for(2, tp_size=2)
    params = random_params(tree)
    write_checkpoint(tmp_path, qwen3_hub_tensors(params))
    with record_reads() as reads:
        loaded = load_params(tmp_path, tree, "qwen3_moe", shardings, progress=False)
    assert shardings[GATE_UP].spec == P(None, "tp", None)
    requests = reads_by_request(reads, GATE_UP)
    fused_rows = params[GATE_UP].shape[1]
    assert set(requests) == {((0, 8), (0, fused_rows // 2), (0, 32)), ((0, 8), (fused_rows // 2, fused_rows), (0, 32))}
    for bounds, block_reads in requests.items():
        projection = "gate_proj" if bounds[1][0] == 0 else "up_proj"
        assert {read.key.rsplit(".", 2)[1] for read in block_reads} == {projection}
        assert sum(read.nbytes for read in block_reads) == params[GATE_UP].nbytes // 2
    # Replicated parameters are read once, not once per device.
    assert len([read for read in reads if read.key == "model.norm.weight"]) == 1
    assert_loaded(loaded, params)


def test_dtype_casts_after_reading_and_is_checked_without_it(tmp_path):
    tree = qwen3_tree()
    params = {name: value.astype(BFLOAT16) for name, value in random_params(tree).items()}
    write_checkpoint(tmp_path, qwen3_hub_tensors(params))
    with pytest.raises(CheckpointMismatchError, match=r"(?s)dtype mismatch .*: checkpoint stores bfloat16") as caught:
        load_params(tmp_path, tree, "qwen3_moe", progress=False)
    assert any(entry.startswith("model.norm.weight: checkpoint stores bfloat16")
               for entry in caught.value.dtype_mismatches)   # the message lists the first few
    loaded = load_params(tmp_path, tree, "qwen3_moe", dtype=np.float32, progress=False)
    assert_loaded(loaded, {name: value.astype(np.float32) for name, value in params.items()})
    assert_loaded(load_params(tmp_path, qwen3_tree("bfloat16"), "qwen3_moe", progress=False), params)


def test_all_mismatches_are_reported_in_one_error(tmp_path):
    tree = qwen3_tree()
    params = random_params(tree)
    hub = qwen3_hub_tensors(params)
    del hub["model.norm.weight"]
    del hub[f"{SPARSE_LAYER}.mlp.experts.5.up_proj.weight"]
    hub["model.extra.weight"] = np.zeros(3, np.float32)
    hub[f"{SPARSE_LAYER}.mlp.experts.8.gate_proj.weight"] = np.zeros((16, 32), np.float32)  # a 9th expert
    hub[DOWN] = params[DOWN]  # fused down_proj next to its per-expert keys
    hub["model.layers.0.self_attn.q_proj.weight"] = np.zeros((33, 32), np.float32)
    write_checkpoint(tmp_path, hub, max_shard_bytes=20_000)
    with pytest.raises(CheckpointMismatchError) as caught:
        load_params(tmp_path, tree, "qwen3_moe", progress=False)
    error = caught.value
    # Declaration order: layer 1's experts come before the final norm.
    assert error.missing == [f"{SPARSE_LAYER}.mlp.experts.5.up_proj.weight (for {GATE_UP})", "model.norm.weight"]
    assert error.unexpected == ["model.extra.weight", f"{SPARSE_LAYER}.mlp.experts.8.gate_proj.weight"]
    assert len(error.duplicated) == 1 and error.duplicated[0].startswith(f"{DOWN}: given as hub keys")
    assert error.shape_mismatches == [
        "model.layers.0.self_attn.q_proj.weight: checkpoint gives [33, 32] "
        "(model.layers.0.self_attn.q_proj.weight [33, 32] float32), the model declares [32, 32]"
    ]
    assert "missing (2;" in str(error) and "unexpected (2;" in str(error) and "Fix:" in str(error)


def mutate_index(directory, change):
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    change(index["weight_map"])
    path.write_text(json.dumps(index))


def first_shard(directory):
    return directory / "model-00001-of-00004.safetensors"


def truncate(directory):
    path = first_shard(directory)
    path.write_bytes(path.read_bytes()[:-100])


def corrupt_header(directory):
    path = first_shard(directory)
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"\xff" + data[9:])


def escape_directory(directory):
    mutate_index(directory, lambda weight_map: weight_map.update({"lm_head.weight": "../model-00001-of-00004.safetensors"}))


def remove_shard(directory):
    (directory / "model-00003-of-00004.safetensors").unlink()


def rewrite(directory, change):
    """Rewrite the checkpoint's tensors after `change` (a fresh, well-formed checkpoint with other keys)."""
    tensors = read_checkpoint(directory)
    for path in directory.iterdir():
        path.unlink()
    change(tensors)
    write_checkpoint(directory, tensors, max_shard_bytes=40_000)


@pytest.mark.parametrize(
    "damage, error_type, message",
    [
        (truncate, CheckpointFormatError, r"model-00001-of-00004.safetensors: .*truncated"),
        (corrupt_header, CheckpointFormatError, r"model-00001-of-00004.safetensors: the header is not valid UTF-8 JSON"),
        (remove_shard, CheckpointFormatError, r"names shard file 'model-00003-of-00004.safetensors'.*does not exist"),
        (escape_directory, CheckpointFormatError, r"entry 'lm_head.weight' names shard file '\.\./"),
        (lambda d: rewrite(d, lambda t: t.update({"model.norm.weight": np.zeros(31, np.float32)})),
         CheckpointMismatchError, r"(?s)shape mismatch .*model.norm.weight: checkpoint gives \[31\]"),
        (lambda d: rewrite(d, lambda t: t.pop("lm_head.weight")), CheckpointMismatchError, r"missing .*\n    lm_head.weight"),
        (lambda d: rewrite(d, lambda t: t.update({"model.rotary.inv_freq": np.ones(4, np.float32)})),
         CheckpointMismatchError, r"unexpected .*\n    model.rotary.inv_freq"),
        (lambda d: rewrite(d, lambda t: t.update({GATE_UP: np.zeros((8, 32, 32), np.float32)})),
         CheckpointMismatchError, rf"duplicated .*\n    {re.escape(GATE_UP)}: given as hub keys .* and as {re.escape(GATE_UP)} itself"),
    ],
    ids=["truncated", "corrupt-header", "missing-shard", "dotdot-in-index", "wrong-shape", "missing-key",
         "unexpected-key", "duplicated-key"],
)
def test_bad_checkpoints_raise_naming_the_problem(tmp_path, damage, error_type, message):
    tree = qwen3_tree()
    write_checkpoint(tmp_path, qwen3_hub_tensors(random_params(tree)), max_shard_bytes=40_000)
    assert first_shard(tmp_path).exists() and (tmp_path / "model-00004-of-00004.safetensors").exists()
    damage(tmp_path)
    with pytest.raises(error_type, match=message):
        load_params(tmp_path, tree, "qwen3_moe", progress=False)


def test_shardings_must_cover_every_parameter(tmp_path):
    tree = qwen3_tree()
    write_checkpoint(tmp_path, qwen3_hub_tensors(random_params(tree)))
    _, shardings = shardings_for(8, fsdp_size=8, ep_size=8)
    partial = dict(shardings)
    del partial["lm_head.weight"]
    with pytest.raises(ValueError, match=r"missing for \['lm_head.weight'\]"):
        load_params(tmp_path, tree, "qwen3_moe", partial, progress=False)
    with pytest.raises(TypeError, match="NamedSharding"):
        load_params(tmp_path, tree, "qwen3_moe", {**shardings, "lm_head.weight": P()}, progress=False)


@pytest.mark.reference
@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral"])
def test_transformers_checkpoint_loads_as_its_in_memory_state_dict(tmp_path, architecture):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if architecture == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_CONFIG))
        tree = qwen3_tree()
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL_CONFIG))
        tree = mixtral_tree()
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists() or architecture == "mixtral"
    state = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    assert_loaded(load_params(tmp_path, tree, architecture, progress=False), state)


def test_a_parameter_with_no_layout_at_all_names_both_layouts(tmp_path):
    tree = qwen3_tree()
    hub = {key: value for key, value in qwen3_hub_tensors(random_params(tree)).items()
           if not key.endswith(("gate_proj.weight", "up_proj.weight")) or ".experts." not in key}
    write_checkpoint(tmp_path, hub)
    with pytest.raises(CheckpointMismatchError) as caught:
        load_params(tmp_path, tree, "qwen3_moe", progress=False)
    assert caught.value.missing == [
        f"{GATE_UP} (neither it nor {SPARSE_LAYER}.mlp.experts.{{expert}}.gate_proj.weight + "
        f"{SPARSE_LAYER}.mlp.experts.{{expert}}.up_proj.weight is in the checkpoint)"
    ]
    assert caught.value.unexpected == []
