"""Every layout of N devices a model can run on, and why each other one cannot.

    candidates, excluded = enumerate_layouts(config_values, devices=8, batch_size=16, seq_len=128)
    candidates[0].layout.distributed_config(), candidates[0].model     # an abstract model: shardings, no devices
    excluded[0].layout, excluded[0].reason

A layout is the sizes `tp x fsdp x dp_replicate x pp x cp = N`, an `ep` that regroups those devices (1, or a
multiple of tp dividing fsdp x tp, or under cp expert groups that nest in cp: `ep_sizes`), the EP implementation
(each registered one but "auto", which picks one of them), with pp > 1 how the batch streams through the stages
(`PIPELINE_CHOICES`) and with cp > 1 how attention reaches the other ranks' keys (`CP_STRATEGIES`).

Context parallelism (cp > 1) is enumerated for training only (a KV cache step does not split the sequence),
without pipeline stages, and only for sequences long enough to matter: `seq_len >= CP_MIN_SEQ_LEN` and a
multiple of 2 x cp (the zig-zag chunks). Below that, a sequence's activations are small beside the weights and
the batch is the cheaper dimension to split; cp's key / value exchange in every attention layer would cost more
than it saves. Legality is the
library's own: `DistributedConfig` checks the sizes, building the model checks the shardings (heads, experts,
layers per stage), the EP implementation's constructor checks the groups, and the batch must split over the
data-parallel groups and microbatches as the train step requires. Nothing here needs a device.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from ..causal_lm.auto import AutoModelForCausalLM
from ..distributed.config import DistributedConfig
from ..distributed.expert_parallel import EPImplementationInterface, ExpertGroups, build_ep_implementation
from ..distributed.mesh import STAGE_MESH_AXES, DeviceLayout
from ..models.step_checks import check_batch

# With pp > 1: (schedule, repeats, microbatches per stage). GPipe at one and two microbatches per stage (the
# bubble fraction (pp - 1) / (M + pp - 1) shrinks as M grows, the activations held do not), and a circular
# schedule of two chunks per stage (a bubble of (pp - 1) / (2M + pp - 1)).
PIPELINE_CHOICES = (("gpipe", 1, 1), ("gpipe", 1, 2), ("circular", 2, 1))
# Modes the planner knows and whether their programs run pipeline stages.
MODES_WITH_PIPELINES = {"train": True, "serve": False}
# The shortest sequence for which the planner tries context parallelism (see the module docstring).
CP_MIN_SEQ_LEN = 4096


@dataclass(frozen=True)
class PipelineChoice:
    """How a batch streams through the stages: `microbatches` of it, each passing every stage `repeats` times."""

    microbatches: int
    schedule: str = "gpipe"
    repeats: int = 1


@dataclass(frozen=True)
class Layout:
    """One way to lay a model over devices: the `DistributedConfig` sizes, the EP implementation and, with
    pipeline stages, the microbatches and schedule."""

    tp: int
    ep: int
    fsdp: int
    dp_replicate: int
    pp: int
    ep_implementation: str = "auto"
    pipeline: PipelineChoice | None = None
    cp: int = 1
    cp_strategy: str = "all_gather"

    @property
    def devices(self) -> int:
        return self.tp * self.fsdp * self.dp_replicate * self.pp * self.cp

    @property
    def data_parallel(self) -> int:
        return self.fsdp * self.dp_replicate

    def config_sizes(self) -> dict:
        return {"tp_size": self.tp, "ep_size": self.ep, "fsdp_size": self.fsdp,
                "dp_replicate_size": self.dp_replicate, "pp_size": self.pp, "cp_size": self.cp,
                "ep_implementation": self.ep_implementation,
                **({"cp_strategy": self.cp_strategy} if self.cp > 1 else {})}

    def distributed_config(self) -> DistributedConfig:
        return DistributedConfig(**self.config_sizes())

    def model_options(self) -> dict:
        """The model's pipeline keyword arguments ({} without stages)."""
        if self.pipeline is None:
            return {}
        return {"pipeline_microbatches": self.pipeline.microbatches, "pipeline_schedule": self.pipeline.schedule,
                "pipeline_repeats": self.pipeline.repeats}

    @property
    def pipeline_iterations(self) -> int | None:
        """The pipeline loop's trip count, M x repeats + pp - 1 (None without stages)."""
        return None if self.pipeline is None else self.pipeline.microbatches * self.pipeline.repeats + self.pp - 1

    @property
    def bubble_fraction(self) -> float:
        return 0.0 if self.pipeline is None else (self.pp - 1) / self.pipeline_iterations

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp}", f"ep{self.ep}", f"fsdp{self.fsdp}"]
        parts += [f"dp_replicate{self.dp_replicate}"] if self.dp_replicate > 1 else []
        parts += [f"cp{self.cp}/{self.cp_strategy}"] if self.cp > 1 else []
        if self.pipeline is not None:
            parts.append(f"pp{self.pp}/M{self.pipeline.microbatches}")
            if self.pipeline.schedule != "gpipe":
                parts[-1] += f"/{self.pipeline.schedule}x{self.pipeline.repeats}"
        if self.ep > 1:
            parts.append(self.ep_implementation)
        return " ".join(parts)

    def flags(self) -> str:
        """The layout as `moe-jax` command-line flags."""
        flags = [f"--tp {self.tp}", f"--fsdp {self.fsdp}", f"--ep {self.ep}"]
        flags += [f"--dp-replicate {self.dp_replicate}"] if self.dp_replicate > 1 else []
        flags += [f"--cp {self.cp} --cp-strategy {self.cp_strategy}"] if self.cp > 1 else []
        if self.pipeline is not None:
            flags += [f"--pp {self.pp}", f"--pp-microbatches {self.pipeline.microbatches}"]
            if self.pipeline.schedule != "gpipe":
                flags += [f"--pp-schedule {self.pipeline.schedule}", f"--pp-repeats {self.pipeline.repeats}"]
        flags += [f"--ep-implementation {self.ep_implementation}"] if self.ep > 1 else []
        return " ".join(flags)


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    model: object          # the abstract `MoeForCausalLM` of the layout (plans and shardings, no mesh)


@dataclass(frozen=True)
class Excluded:
    layout: Layout
    reason: str


def divisors(count: int) -> list[int]:
    return [d for d in range(1, count + 1) if count % d == 0]


def ep_sizes(tp: int, fsdp: int, cp: int = 1) -> list[int]:
    """1 (no expert parallelism) and every multiple of tp that divides fsdp x tp, above 1; under cp, the expert
    groups (ep / tp devices of cp x fsdp) must nest in cp: ep / tp divides cp, or is cp times a divisor of fsdp
    (`DistributedConfig`'s `check_context_parallel`)."""
    if cp == 1:
        return [1] + [tp * d for d in divisors(fsdp) if tp * d > 1]
    groups = sorted(set(divisors(cp)) | {cp * d for d in divisors(fsdp)})
    return [1] + [tp * g for g in groups if tp * g > 1]


def cp_sizes(devices: int, mode: str, seq_len: int | None) -> list[int]:
    """The cp sizes to try: 1, and in training with `seq_len >= CP_MIN_SEQ_LEN` every divisor of `devices`
    above 1 that splits `seq_len` into 2 x cp chunks."""
    if mode != "train" or seq_len is None or seq_len < CP_MIN_SEQ_LEN:
        return [1]
    return [cp for cp in divisors(devices) if cp == 1 or seq_len % (2 * cp) == 0]


def cp_strategies(cp: int) -> list[str]:
    """How attention runs under cp: both strategies (their memory and collectives differ); none without cp."""
    from ..distributed.config import CP_STRATEGIES

    return ["all_gather"] if cp == 1 else list(CP_STRATEGIES)


def ep_implementations(ep: int) -> list[str]:
    """The registered EP implementations to try with `ep` ("auto" only picks among them; none without EP)."""
    return ["auto"] if ep == 1 else [name for name in EPImplementationInterface() if name != "auto"]


def pipeline_choices(pp: int) -> list[PipelineChoice | None]:
    if pp == 1:
        return [None]
    return [PipelineChoice(pp * per_stage, schedule, repeats) for schedule, repeats, per_stage in PIPELINE_CHOICES]


def layout_space(devices: int, mode: str = "train", seq_len: int | None = None) -> list[Layout]:
    """Every combination of sizes for `devices`, before any check of the model or batch; cp > 1 (without
    pipeline stages) only where `cp_sizes` tries it for `seq_len`."""
    layouts = []
    for cp in cp_sizes(devices, mode, seq_len):
        stage_counts = divisors(devices // cp) if MODES_WITH_PIPELINES[mode] and cp == 1 else [1]
        for pp in stage_counts:
            rest = devices // cp // pp
            for dp_replicate in divisors(rest):
                for tp in divisors(rest // dp_replicate):
                    fsdp = rest // dp_replicate // tp
                    for ep in ep_sizes(tp, fsdp, cp):
                        for implementation in ep_implementations(ep):
                            layouts += [Layout(tp, ep, fsdp, dp_replicate, pp, implementation, pipeline, cp, strategy)
                                        for pipeline in pipeline_choices(pp) for strategy in cp_strategies(cp)]
    return layouts


@contextmanager
def quiet_model_building():
    """Plan warnings (a tp_plan rule that matches nothing here) said once per layout would bury the answer."""
    logger = logging.getLogger("moe_jax")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def check_ep_implementation(layout: Layout, num_experts: int) -> None:
    """The implementation's own constructor on the layout's groups (raises as it would in the model)."""
    if layout.ep == 1:
        return
    device_layout = DeviceLayout(layout.pp, layout.dp_replicate, layout.fsdp, layout.tp, layout.ep, layout.cp)
    groups = ExpertGroups(ep_axes=device_layout.ep_axes, tp_axes=device_layout.tp_axes, ep_size=layout.ep,
                          tp_size=layout.tp, all_axes=STAGE_MESH_AXES)
    build_ep_implementation(layout.ep_implementation, None, max(num_experts // layout.ep, 1), groups)


def batch_error(layout: Layout, batch_size: int, seq_len: int, grad_accum: int = 1) -> str | None:
    """Why the train step cannot split `batch_size` on this layout (None when it can)."""
    if batch_size % grad_accum:
        return f"batch size {batch_size} is not a multiple of grad_accum={grad_accum}"
    microbatches = 1 if layout.pipeline is None else layout.pipeline.microbatches
    if seq_len % (2 * layout.cp):
        return (f"sequence length {seq_len} cannot be split over cp={layout.cp}: it must be a multiple of "
                f"2 x cp = {2 * layout.cp} (the zig-zag chunks)")
    try:
        check_batch((batch_size // grad_accum, seq_len), layout.data_parallel, microbatches)
    except ValueError as error:
        return str(error)
    return None


def enumerate_layouts(config_values: dict, *, devices: int, batch_size: int, seq_len: int, mode: str = "train",
                      grad_accum: int = 1, model_options: dict | None = None,
                      space: Callable[[int, str], list[Layout]] = None) -> tuple[list[Candidate], list[Excluded]]:
    """(the legal layouts with their abstract models, the others with the reason), in `space` order (default
    `layout_space`: every combination)."""
    if mode not in MODES_WITH_PIPELINES:
        raise ValueError(f"mode {mode!r} is not one of {sorted(MODES_WITH_PIPELINES)}.")
    candidates, excluded = [], []
    with quiet_model_building():
        for layout in (space(devices, mode) if space else layout_space(devices, mode, seq_len)):
            try:
                config = layout.distributed_config()
            except (ValueError, NotImplementedError) as error:
                excluded.append(Excluded(layout, str(error)))
                continue
            # before building the model: the batch check is arithmetic, the model takes milliseconds
            if (reason := batch_error(layout, batch_size, seq_len, grad_accum if mode == "train" else 1)):
                excluded.append(Excluded(layout, reason))
                continue
            try:
                model = AutoModelForCausalLM.from_config(config_values, config, abstract=True,
                                                         **(model_options or {}), **layout.model_options())
                check_ep_implementation(layout, model.config.num_experts)
            except (ValueError, NotImplementedError) as error:
                excluded.append(Excluded(layout, str(error)))
                continue
            candidates.append(Candidate(layout, model))
    return candidates, excluded
