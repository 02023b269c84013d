"""Where training metrics go besides the JSONL: TensorBoard event files (`--tensorboard`), model FLOPs and MFU
(`moe_jax.training.throughput`), and `scripts/plot_run.py`'s PNG."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.cli import main
from moe_jax.cli.train_progress import RankBalance
from moe_jax.distributed.eplb import balanced_placement
from moe_jax.training import make_train_step
from moe_jax.training.loop import TrainLoop
from moe_jax.training.tensorboard import TensorBoardWriter
from moe_jax.training.throughput import active_parameters, train_flops_per_token

from .hf_training import CHECKPOINT
from .test_rebalance import SkewedBatches

ROOT = Path(__file__).resolve().parents[2]


def summaries(logdir: Path) -> dict[str, list[tuple[int, object]]]:
    """tag -> [(step, value)] from the event files in `logdir` (TFRecord framing, tensorboardX's protos): a
    scalar's value, or a histogram's (bucket_limit, bucket) lists."""
    from tensorboardX.proto import event_pb2

    found: dict[str, list[tuple[int, object]]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            length = struct.unpack("<Q", data[offset:offset + 8])[0]
            event = event_pb2.Event()
            event.ParseFromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                content = ((list(value.histo.bucket_limit), list(value.histo.bucket)) if value.HasField("histo")
                           else value.simple_value)
                found.setdefault(value.tag, []).append((event.step, content))
    return found


def test_active_parameters_count_top_k_of_the_routed_experts():
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, devices=jax.devices()[:1], progress=False)
    c = model.config
    per_layer_attention = (2 * c.hidden_size * c.num_attention_heads * c.head_dim
                           + 2 * c.hidden_size * c.num_key_value_heads * c.head_dim)
    expected = c.vocab_size * c.hidden_size      # the head (untied); the embedding is a lookup
    for layer in range(c.num_hidden_layers):
        expected += per_layer_attention
        if model.family.is_sparse(c, layer):
            expected += c.num_experts * c.hidden_size                      # the router
            expected += c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size
        else:
            expected += 3 * c.hidden_size * c.intermediate_size
    assert active_parameters(model) == expected
    width = c.num_attention_heads * c.head_dim
    assert train_flops_per_token(model, 24) == 6 * expected + 6 * c.num_hidden_layers * 24 * width


def test_tensorboard_event_files_hold_the_jsonl_metrics_and_plot_run_draws_them(tmp_path):
    pytest.importorskip("tensorboardX")
    np.save(tmp_path / "train.npy", np.random.default_rng(0).integers(0, 128, (32, 24)).astype(np.int32))
    jsonl, logdir = tmp_path / "metrics.jsonl", tmp_path / "tb"
    assert main(["train", "--model", str(CHECKPOINT), "--data", str(tmp_path / "train.npy"), "--steps", "4",
                 "--lr-schedule", "linear", "--warmup-steps", "1", "--eval-data", str(tmp_path / "train.npy"),
                 "--eval-every", "2", "--eval-batches", "1", "--tensorboard", str(logdir), "--peak-tflops", "1",
                 "--metrics-jsonl", str(jsonl), "--no-progress"]) == 0
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    found = summaries(logdir)
    for tag, name in (("train/loss", "loss"), ("train/lr", "lr"), ("eval/eval_loss", "eval_loss"),
                      ("throughput/mfu", "mfu"), ("throughput/tokens_per_s_per_device", "tokens_per_s_per_device")):
        expected = [(r["step"], r[name]) for r in records if name in r]
        assert [step for step, _ in found[tag]] == [step for step, _ in expected], tag
        np.testing.assert_allclose([v for _, v in found[tag]], [v for _, v in expected], rtol=1e-6)
    assert all(r["mfu"] == pytest.approx(r["model_tflops_per_s_per_device"]) for r in records)
    # Router load: per sparse layer (named by its model layer), tokens per expert, a bucket per expert.
    config = json.loads((CHECKPOINT / "config.json").read_text())
    sparse = [layer for layer in range(config["num_hidden_layers"]) if layer not in config.get("mlp_only_layers", [])]
    for record in records:
        assert record["expert_load_layers"] == sparse
        load = np.asarray(record["expert_load"])
        assert load.shape == (len(sparse), config["num_local_experts"])
        assert (load.sum(axis=1) == config["num_experts_per_tok"] * 8 * 24).all()    # every token, top-k times
        assert "ep_rank_load" not in record                                           # one device: no ep ranks
    for index, layer in enumerate(sparse):
        histograms = found[f"router_load/layer_{layer}"]
        assert [step for step, _ in histograms] == [r["step"] for r in records]
        for (_, (limits, counts)), record in zip(histograms, records):
            assert limits == [e + 0.5 for e in range(config["num_local_experts"])]
            assert counts == record["expert_load"][index]
        ratios = [value for _, value in found[f"router_load/layer_{layer}_max_over_mean"]]
        expected = [max(r["expert_load"][index]) / np.mean(r["expert_load"][index]) for r in records]
        np.testing.assert_allclose(ratios, expected, rtol=1e-6)
    assert [value for _, value in found["dispatch/padded"]] == [r["padded"] for r in records]

    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "scripts"))
    import plot_run

    assert plot_run.main([str(jsonl), "-o", str(tmp_path / "run.png")]) == 0
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty.jsonl").write_text("")
    assert plot_run.main([str(tmp_path / "empty.jsonl")]) == 2


def test_plot_run_names_heat_map_rows_by_the_model_s_layer_index_on_whole_ticks():
    """(was: fractional y ticks, rows numbered 0..L-1 where TensorBoard says layer_1..L)"""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(ROOT / "scripts"))
    import plot_run

    load = [[5, 1, 0, 2], [0, 3, 3, 2], [1, 1, 4, 2]]      # 3 sparse layers after a dense layer 0, 4 experts
    records = [{"step": step, "expert_load": load, "expert_load_layers": [1, 2, 3]} for step in (1, 2)]
    figure, (balance, heat) = plt.subplots(1, 2)
    plot_run.router_load_panels(records, balance, heat, figure)
    figure.canvas.draw()
    rows = [tick for tick in heat.get_yticks() if -0.5 <= tick <= 2.5]
    assert rows == [0, 1, 2]
    assert [label.get_text() for label in heat.get_yticklabels() if label.get_text()] == ["1", "2", "3"]
    assert all(float(tick).is_integer() for tick in heat.get_xticks())
    assert heat.get_ylabel() == "layer"
    assert [line.get_label() for line in balance.get_lines()] == ["layer 1", "layer 2", "layer 3"]
    plt.close(figure)


def max_over_mean(load) -> np.ndarray:
    load = np.asarray(load, np.float64)
    return load.max(-1) / load.mean(-1)


def test_ep_rank_load_in_the_train_metrics_tensorboard_and_plot_run(tmp_path):
    """Experts dispatched over ep: each step's record holds ep_rank_load [sparse layers, ep], each rank's share of
    expert_load (plain EP: rank r holds experts 2r, 2r + 1), or with redundant slots the same pairs as the
    placement spreads them; TensorBoard logs each layer's busiest rank over the mean, plot_run draws it dashed."""
    pytest.importorskip("tensorboardX")
    records = {}
    for slots in (0, 4):
        model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, DistributedConfig(fsdp_size=8, ep_size=4),
                                                     progress=False, num_redundant_experts=slots)
        if slots:   # placed for the plain run's load: the busy experts get the replicas
            model.set_expert_placement(balanced_placement(np.asarray(records[0][0]["expert_load"]),
                                                          num_redundant_experts=slots, ep_size=4))
        train_step = make_train_step(model, optax.sgd(1e-3))
        state = train_step.init_state(seed=0, capacity=model.capacity_schedule.largest)
        TrainLoop(train_step, SkewedBatches(), on_step=records.setdefault(slots, []).append).run(state, 2)
    for record in records[0]:
        load, ranks = np.asarray(record["expert_load"]), np.asarray(record["ep_rank_load"])
        assert ranks.shape == (2, 4)
        np.testing.assert_array_equal(ranks, load.reshape(2, 4, 2).sum(-1))
    first, placed = records[0][0], records[4][0]         # the same batch, the same parameters
    np.testing.assert_array_equal(placed["expert_load"], first["expert_load"])
    np.testing.assert_array_equal(np.sum(placed["ep_rank_load"], 1), np.sum(first["ep_rank_load"], 1))
    assert (max_over_mean(placed["ep_rank_load"]) < max_over_mean(first["ep_rank_load"])).all()

    writer = TensorBoardWriter(tmp_path / "tb")
    for record in records[4]:
        writer(record)
    writer.close()
    found = summaries(tmp_path / "tb")
    for index, layer in enumerate(placed["expert_load_layers"]):
        ratios = [value for _, value in found[f"ep_rank_load/layer_{layer}_max_over_mean"]]
        np.testing.assert_allclose(ratios, [max_over_mean(r["ep_rank_load"])[index] for r in records[4]], rtol=1e-6)

    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(ROOT / "scripts"))
    import plot_run

    figure, (balance, heat) = plt.subplots(1, 2)
    plot_run.router_load_panels(records[4], balance, heat, figure)
    lines = {line.get_label(): line for line in balance.get_lines()}
    assert list(lines) == ["layer 1", "layer 2", "layer 1 ep ranks", "layer 2 ep ranks"]
    np.testing.assert_allclose(lines["layer 2 ep ranks"].get_ydata(),
                               [max_over_mean(r["ep_rank_load"])[1] for r in records[4]])
    assert lines["layer 1 ep ranks"].get_linestyle() == "--"
    plt.close(figure)


def test_plot_run_draws_grad_norm_and_the_loss_terms_marks_re_placements_and_the_resume_and_fits_its_titles():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(ROOT / "scripts"))
    import plot_run

    load = [[5, 1, 0, 2], [0, 3, 3, 2]]
    records = [{"step": step, "loss": 2.0 / step, "grad_norm": 1.0 + step, "aux_loss": 0.1, "router_z_loss": 0.5,
                "lr": 1e-3, "tokens_per_s": 100.0, "capacity": 1.25, "replayed": step == 2, "expert_load": load,
                "expert_load_layers": [1, 2], "ep_rank_load": [[6, 2], [3, 5]]} for step in range(1, 7)]
    records[2]["rebalanced"] = True
    records[4]["resumed"] = True
    figure = plot_run.draw(records)
    figure.canvas.draw()
    panels = {axis.get_title(): axis for axis in figure.axes if axis.get_title()}
    grad = panels["gradient norm"].get_lines()[0]
    assert list(grad.get_xdata()) == list(range(1, 7)) and list(grad.get_ydata())[:2] == [2.0, 3.0]
    assert {"aux loss", "router z loss"} <= {line.get_label() for line in panels["router and MTP loss terms"].lines}
    balance = next(axis for title, axis in panels.items() if title.startswith("router load"))
    verticals = [(line.get_label(), line.get_xdata()[0]) for line in balance.get_lines()
                 if len(set(line.get_xdata())) == 1 and len(line.get_xdata()) == 2]
    assert ("re-placement", 3) in verticals and ("resumed", 5) in verticals
    assert ("resumed", 5) in [(line.get_label(), line.get_xdata()[0]) for line in panels["loss"].get_lines()
                              if line.get_label() == "resumed"]
    renderer, bounds = figure.canvas.get_renderer(), figure.bbox
    for axis in panels.values():     # no title runs past the figure's edges
        extent = axis.title.get_window_extent(renderer)
        assert bounds.x0 <= extent.x0 and extent.x1 <= bounds.x1, axis.get_title()
    plt.close(figure)


def test_a_resumed_run_s_first_record_says_so(tmp_path):
    from moe_jax.cli.train_progress import TrainProgress

    for start, marked in ((0, []), (4, [5])):
        jsonl = tmp_path / f"from_{start}.jsonl"
        progress = TrainProgress(start, start + 2, str(jsonl), False)
        for step in (start + 1, start + 2):
            progress({"step": step, "loss": 1.0, "tokens_per_s": 10.0, "capacity": None, "replays": 0})
        progress.close()
        records = [json.loads(line) for line in jsonl.read_text().splitlines()]
        assert [r["step"] for r in records if r.get("resumed")] == marked


def test_the_run_summary_tallies_the_busiest_ep_rank_after_the_first_re_placement():
    """Steps before the first re-placement (and the re-placing step itself, which ran the old placement) are left
    out; each later step adds one share per sparse layer."""
    balance = RankBalance()
    balance({"ep_rank_load": [[9, 1], [5, 5]]})                          # before any re-placement
    assert balance.summary() is None
    balance({"ep_rank_load": [[9, 1], [5, 5]], "rebalanced": True})
    assert balance.summary() is None
    balance({"ep_rank_load": [[6, 4], [5, 5]]})                          # 1.2, 1.0
    balance({"ep_rank_load": [[7, 3], [4, 6]]})                          # 1.4, 1.2
    assert balance.summary() == ("busiest ep rank after the first re-placement: worst 1.40x the mean, 25% of "
                                 "step-layers over 1.3x")
