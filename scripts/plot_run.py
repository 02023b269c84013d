"""Draw a training run's curves from its metrics JSONL (`moe-jax train --metrics-jsonl`) to one PNG.

    python scripts/plot_run.py metrics.jsonl [-o run.png]

Panels: loss (train, and eval where the run evaluated), learning rate, gradient norm, the router terms (aux loss,
router z-loss, MTP loss, where the records hold them; a GRPO run's reward, clip fraction, logprob gap and routing
mismatch instead, `scripts/rl_grpo.py`), tokens/s per device (and MFU when the run had
--peak-tflops), dispatch capacity (with the steps that were replayed marked), router load balance per sparse layer
(the busiest expert's tokens over the mean, each step; dashed, where the run dispatched experts over ep, the
busiest ep rank's work over the mean, from `ep_rank_load`; dotted verticals at the experts' re-placements,
`rebalanced`) and the last step's tokens per expert and layer; layers are named by their index in the model (the
records' `expert_load_layers`), as TensorBoard's router_load/layer_L. A resumed run's first step (`resumed`) is a
dashed vertical on every panel over steps. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_records(path: Path) -> list[dict]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            raise ValueError(f"{path}:{number}: not a JSON object") from None
    if not records:
        raise ValueError(f"{path}: no records.")
    return records


def series(records: list[dict], name: str) -> tuple[list[int], list[float]]:
    kept = [(r["step"], r[name]) for r in records if isinstance(r.get(name), (int, float))]
    return [step for step, _ in kept], [value for _, value in kept]


def load_layer_names(record: dict) -> tuple[list[str], str]:
    """(a name per expert_load row, the axis label): the model's layer index, as TensorBoard's router_load/layer_L
    tags; records written before they carried `expert_load_layers` only give the row's position."""
    layers = record.get("expert_load_layers")
    if layers is not None:
        return [str(layer) for layer in layers], "layer"
    return [f"#{row}" for row in range(len(record["expert_load"]))], "sparse layer (position)"


def max_over_mean(load: list[list[float]]) -> list[float]:
    """Per row (a sparse layer), the largest count over the row's mean (1.0: even)."""
    return [max(row) / max(sum(row) / len(row), 1e-12) for row in load]


def router_load_panels(records: list[dict], balance, heat, figure) -> None:
    """Per sparse layer, max / mean tokens per expert over the steps; the last step's loads as a heat map, a row
    per layer named by its index in the model."""
    loaded = [r for r in records if r.get("expert_load")]
    balance.set_title("router load: busiest expert / mean,\nper layer")
    heat.set_title("tokens per expert (last step)")
    if not loaded:
        for axis in (balance, heat):
            axis.text(0.5, 0.5, "no expert_load in the records", ha="center", va="center", transform=axis.transAxes)
        return
    steps = [r["step"] for r in loaded]
    names, label = load_layer_names(loaded[-1])
    ratios = [max_over_mean(r["expert_load"]) for r in loaded]
    lines = [balance.plot(steps, curve, label=f"{label} {name}")[0] for name, curve in zip(names, zip(*ratios))]
    ranked = [r for r in loaded if r.get("ep_rank_load")]
    if ranked:   # each layer's busiest ep rank over the mean, dashed in its layer's colour
        balance.set_title("router load over mean, per layer:\nbusiest expert (solid), busiest ep rank (dashed)")
        rank_ratios = [max_over_mean(r["ep_rank_load"]) for r in ranked]
        for name, line, curve in zip(names, lines, zip(*rank_ratios)):
            balance.plot([r["step"] for r in ranked], curve, "--", color=line.get_color(),
                         label=f"{label} {name} ep ranks")
    for index, step in enumerate(r["step"] for r in records if r.get("rebalanced")):
        balance.axvline(step, color="tab:green", linestyle=":", label=None if index else "re-placement")
    if len(ratios[0]) <= 8:
        balance.legend(fontsize="small")
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    image = heat.imshow(loaded[-1]["expert_load"], aspect="auto", interpolation="nearest")
    # Whole rows and experts only (imshow's default ticks fall between rows), each row named by its layer.
    heat.xaxis.set_major_locator(MaxNLocator(integer=True))
    heat.yaxis.set_major_locator(MaxNLocator(integer=True))
    heat.yaxis.set_major_formatter(FuncFormatter(
        lambda row, _: names[int(row)] if float(row).is_integer() and 0 <= row < len(names) else ""))
    heat.set_xlabel("expert")
    heat.set_ylabel(label)
    figure.colorbar(image, ax=heat)


def plot(records: list[dict], out: Path) -> None:
    import matplotlib.pyplot as plt

    figure = draw(records)
    figure.savefig(out, dpi=100)
    plt.close(figure)


RL_TERMS = ("reward", "clip_fraction", "logprob_gap", "routing_mismatch", "kl")


def draw(records: list[dict]):
    """The run's figure (matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(4, 2, figsize=(11, 13), constrained_layout=True)
    loss, lr, grad_norm, terms, speed, capacity, balance, heat = axes.flat
    loss.plot(*series(records, "loss"), label="train")
    if series(records, "eval_loss")[0]:
        loss.plot(*series(records, "eval_loss"), "o-", label="eval")
    loss.set_title("loss")
    loss.legend()
    if series(records, "lr")[0]:
        lr.plot(*series(records, "lr"))
    lr.set_title("learning rate")
    grad_norm.plot(*series(records, "grad_norm"))
    grad_norm.set_title("gradient norm")
    rl_run = bool(series(records, "reward")[0])   # scripts/rl_grpo.py's records: this panel shows the RL terms
    names = RL_TERMS if rl_run else ("aux_loss", "router_z_loss", "mtp_loss")
    drawn = [name for name in names if any(series(records, name)[1])]
    for name in drawn:
        terms.plot(*series(records, name), label=name.replace("_", " "))
    if drawn:
        terms.legend()
    else:
        terms.text(0.5, 0.5, "no aux, z- or MTP loss in the records", ha="center", va="center",
                   transform=terms.transAxes)
    terms.set_title("reward and RL terms" if rl_run else "router and MTP loss terms")
    name = "tokens_per_s_per_device" if series(records, "tokens_per_s_per_device")[0] else "tokens_per_s"
    speed.plot(*series(records, name), label=name.replace("_", " "))
    if series(records, "mfu")[0]:
        twin = speed.twinx()
        twin.plot(*series(records, "mfu"), color="tab:orange", label="MFU")
        twin.set_ylabel("MFU")
    speed.set_title("throughput")
    speed.legend(loc="lower right")
    if series(records, "capacity")[0]:
        capacity.step(*series(records, "capacity"), where="post", label="capacity")
        replayed = [r["step"] for r in records if r.get("replayed")]
        if replayed:
            capacity.plot(replayed, [next(r["capacity"] for r in records if r["step"] == s) for s in replayed],
                          "rx", label="replayed")
        capacity.legend()
    else:
        capacity.text(0.5, 0.5, "no dispatch buffers (ep 1)", ha="center", va="center", transform=capacity.transAxes)
    capacity.set_title("dispatch capacity")
    for axis in axes.flat[:7]:
        axis.set_xlabel("step")
    router_load_panels(records, balance, heat, figure)
    for step in (r["step"] for r in records if r.get("resumed")):
        for axis in axes.flat[:7]:
            axis.axvline(step, color="gray", linestyle="--", label="resumed")
        loss.legend()
    return figure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path, help="the run's metrics JSONL")
    parser.add_argument("-o", "--out", type=Path, default=None, help="the PNG to write (default: METRICS.png)")
    args = parser.parse_args(argv)
    try:
        records = read_records(args.metrics)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = args.out or args.metrics.with_suffix(".png")
    plot(records, out)
    print(f"wrote {out} ({len(records)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
