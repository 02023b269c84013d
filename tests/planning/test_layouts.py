"""Every legal layout of 8 devices for the tiny Qwen3-MoE appears exactly once, checked against an enumeration
written here from the rules themselves."""

from pathlib import Path

from moe_jax.checkpoint_files import read_config
from moe_jax.planning.layouts import Layout, PipelineChoice, enumerate_layouts
from moe_jax.planning.search import plan_layouts

CHECKPOINT = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3_moe"
BATCH, SEQ = 16, 32


def independent_layouts(devices: int, batch: int, layers: int, experts: int) -> set[Layout]:
    """The rules written out: tp x fsdp x dp_replicate x pp = devices; ep is 1 or a multiple of tp dividing
    fsdp x tp, and divides the experts; all_to_all for any ep > 1, all_reduce when ep == tp (one shared batch);
    pp at most the layers, with gpipe at pp and 2 pp microbatches and circular (2 repeats) when the layers split
    into 2 pp chunks; the batch splits over the data-parallel groups times the microbatches. The tiny model's
    widths (32 hidden, 4 x 8 query rows, 2 x 8 key rows, 16 expert rows) divide by every tp up to 8."""
    found = set()
    for pp in (1, 2, 4, 8):
        for dp_replicate in (1, 2, 4, 8):
            for tp in (1, 2, 4, 8):
                if devices % (pp * dp_replicate * tp):
                    continue
                fsdp = devices // (pp * dp_replicate * tp)
                eps = {1} | {tp * k for k in range(1, fsdp + 1) if fsdp % k == 0 and tp * k > 1}
                for ep in sorted(eps):
                    if experts % ep:
                        continue
                    implementations = ["auto"] if ep == 1 else ["all_to_all"] + (["all_reduce"] if ep == tp else [])
                    pipelines = [None] if pp == 1 else [
                        PipelineChoice(pp), PipelineChoice(2 * pp)] + (
                        [PipelineChoice(pp, "circular", 2)] if layers % (2 * pp) == 0 else [])
                    if pp > layers:
                        continue
                    for implementation in implementations:
                        for pipeline in pipelines:
                            microbatches = 1 if pipeline is None else pipeline.microbatches
                            if batch % (fsdp * dp_replicate * microbatches) == 0:
                                found.add(Layout(tp, ep, fsdp, dp_replicate, pp, implementation, pipeline))
    return found


def test_every_legal_layout_is_a_row_exactly_once():
    values = read_config(CHECKPOINT)
    expected = independent_layouts(8, BATCH, values["num_hidden_layers"], values["num_local_experts"])
    plan = plan_layouts(CHECKPOINT, devices=8, batch_size=BATCH, seq_len=SEQ, max_compiles=0)
    rows = [estimate.layout for estimate in plan.estimates]
    assert len(rows) == len(set(rows))
    assert set(rows) == expected
    assert any(layout.pp == 2 for layout in rows) and any(layout.dp_replicate > 1 for layout in rows)
    assert [estimate.rank for estimate in plan.estimates] == list(range(1, len(rows) + 1))


def test_the_layouts_left_out_say_why():
    _, excluded = enumerate_layouts(read_config(CHECKPOINT), devices=8, batch_size=BATCH, seq_len=SEQ)
    reasons = {item.layout.name: item.reason for item in excluded}
    assert "larger than the model's 3 layers" in reasons["tp1 ep1 fsdp2 pp4/M4"]
    assert "AllReduceEP needs every rank of the expert group to hold the same batch" in reasons[
        "tp1 ep2 fsdp8 all_reduce"]
    assert "split into 4 equal chunks" in reasons["tp1 ep1 fsdp4 pp2/M2/circularx2"]


def test_a_batch_that_does_not_split_leaves_only_the_layouts_it_does_split_over():
    """A batch of 3 splits over no data-parallel group of 8 devices but one: the rest are excluded, each with
    the train step's own words."""
    candidates, excluded = enumerate_layouts(read_config(CHECKPOINT), devices=8, batch_size=3, seq_len=SEQ)
    assert candidates and all(c.layout.data_parallel == 1 and c.layout.pp == 1 for c in candidates)
    batch_reasons = [item.reason for item in excluded if "batch size 3" in item.reason]
    assert batch_reasons and all("use a multiple of" in reason for reason in batch_reasons)
