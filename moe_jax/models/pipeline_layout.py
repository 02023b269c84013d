"""Which layers each pipeline stage runs, and how their parameters are stored for one vmapped stage program.

Stages sit on the mesh's `pp` axis. The layers are cut into `chunks`, one per (stage, repeat):

    gpipe     one chunk per stage, the reference's split (`layer_range_for_rank`): an even split, the last
              stage taking the remainder (10 layers on 3 stages: 0-2, 3-5, 6-9)
    circular  `repeats` chunks per stage of L / (stages * repeats) layers each; chunk c = repeat * stages +
              stage, so a microbatch passes every stage `repeats` times (8 layers, 2 stages, 2 repeats:
              stage 0 runs 0-1 and 4-5, stage 1 runs 2-3 and 6-7)

Every stage runs the same program (`jax.vmap` over stages), so the chunks are aligned slot by slot: slot j of
every chunk is one step of that program. Consecutive slots whose layers agree in structure in every chunk form a
*group*, stored as one stacked parameter per distinct layer kind in it, its flat leading axis ordered (stage,
repeat, slot) so that splitting it over `pp` gives each stage exactly its own layers:

    Qwen3-MoE, 8 layers, pp 2 (gpipe)       model.layers.pp0-3.mlp.experts.gate_up_proj  [8, E, 2I, H]
                                            rows: layers 0 1 2 3 | 4 5 6 7  (stage 0 | stage 1)
    DeepSeek-V3, 4 layers (1 dense), pp 2   model.layers.pp0k0.mlp.gate_proj.weight        [2, I, H]
                                            rows: layer 0 | zeros   (stage 1 has no dense layer at slot 0)
                                            model.layers.pp0k1.mlp.experts.gate_up_proj    [2, E, 2I, H]
                                            rows: zeros | layer 2
                                            model.layers.pp1.mlp.experts.gate_up_proj      [2, E, 2I, H]
                                            rows: layer 1 | layer 3

A slot where a chunk's layer is of another kind (or where the chunk has no layer: the remainder of an uneven
split) holds zeros there and is skipped by a select: such rows cost memory and compute, the price of one
program for every stage; models whose layers are all alike (and an even split) have none.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

PIPELINE_SCHEDULES = ("gpipe", "circular")


@dataclass(frozen=True)
class PipelineKind:
    """One layer kind of a group: `representative` (a layer of this kind, whose static options the program
    uses) and, per chunk (stage-major: stage * repeats + repeat), whether the chunk's layers at the group's
    slots are of this kind."""

    representative: int
    present: tuple[bool, ...]


@dataclass(frozen=True)
class PipelineGroup:
    """Slots [start, stop) of every chunk, run as one scan (more than one slot) or one layer."""

    start: int
    stop: int
    kinds: tuple[PipelineKind, ...]

    @property
    def slots(self) -> int:
        return self.stop - self.start

    def key(self, kind: int) -> str:
        """The group's segment in storage names: "pp0-3", "pp0" (one slot), "pp0k1" (its second kind)."""
        slots = f"pp{self.start}" if self.slots == 1 else f"pp{self.start}-{self.stop - 1}"
        return slots if len(self.kinds) == 1 else f"{slots}k{kind}"


@dataclass(frozen=True)
class PipelineLayout:
    """The stages, the chunks and the groups of one model's pipeline (static; `plan` builds it)."""

    stages: int
    repeats: int
    schedule: str
    chunks: tuple[tuple[int, int], ...]   # (start, stop) per chunk, stage-major: stage * repeats + repeat
    groups: tuple[PipelineGroup, ...]

    @property
    def slots(self) -> int:
        """Slots per chunk: the longest chunk's layer count."""
        return max(stop - start for start, stop in self.chunks)

    def chunk(self, stage: int, repeat: int) -> tuple[int, int]:
        return self.chunks[stage * self.repeats + repeat]

    def layer_at(self, chunk: int, slot: int) -> int | None:
        start, stop = self.chunks[chunk]
        return start + slot if start + slot < stop else None

    def stage_layers(self, stage: int) -> list[int]:
        """The layers stage `stage` runs, in the order it runs them."""
        return [layer for repeat in range(self.repeats) for layer in range(*self.chunk(stage, repeat))]

    def members(self, group: PipelineGroup, kind: int) -> tuple[int | None, ...]:
        """The layer of each row of the group's stacked parameter of kind `kind` (None: a zero row), rows
        ordered (stage, repeat, slot)."""
        rows = []
        for chunk in range(len(self.chunks)):
            present = group.kinds[kind].present[chunk]
            rows += [self.layer_at(chunk, slot) if present else None for slot in range(group.start, group.stop)]
        return tuple(rows)

    @classmethod
    def plan(cls, num_layers: int, stages: int, repeats: int, schedule: str,
             signatures: Sequence[Hashable]) -> PipelineLayout:
        """The layout of `num_layers` layers (`signatures[layer]`: equal for layers of one structure)."""
        chunks = pipeline_chunks(num_layers, stages, repeats, schedule)
        order = [(stage, repeat) for stage in range(stages) for repeat in range(repeats)]
        chunks = tuple(chunks[repeat * stages + stage] for stage, repeat in order)  # stage-major
        slots = max(stop - start for start, stop in chunks)

        def column(slot: int) -> tuple:
            return tuple(signatures[start + slot] if start + slot < stop else None for start, stop in chunks)

        groups, start = [], 0
        for slot in range(1, slots + 1):
            if slot < slots and column(slot) == column(start):
                continue
            kinds = []
            for signature in dict.fromkeys(s for s in column(start) if s is not None):
                present = tuple(s == signature for s in column(start))
                representative = next(first + start for (first, _), here in zip(chunks, present) if here)
                kinds.append(PipelineKind(representative, present))
            groups.append(PipelineGroup(start, slot, tuple(kinds)))
            start = slot
        return cls(stages, repeats, schedule, chunks, tuple(groups))


def pipeline_chunks(num_layers: int, stages: int, repeats: int, schedule: str) -> list[tuple[int, int]]:
    """(start, stop) of each chunk in running order (chunk c = repeat * stages + stage), checked."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline_schedule={schedule!r} is not a schedule; use one of {list(PIPELINE_SCHEDULES)}.")
    if repeats < 1:
        raise ValueError(f"pipeline_repeats={repeats} must be >= 1.")
    if stages > num_layers:
        raise ValueError(f"pp_size={stages} is larger than the model's {num_layers} layers: every pipeline stage "
                         f"needs at least one layer; use a pp_size of at most {num_layers}.")
    if schedule == "gpipe":
        if repeats != 1:
            raise ValueError(f"pipeline_repeats={repeats} needs pipeline_schedule='circular' (gpipe runs each "
                             "stage's layers once).")
        per_stage = num_layers // stages
        return [(stage * per_stage, num_layers if stage == stages - 1 else (stage + 1) * per_stage)
                for stage in range(stages)]
    chunks = stages * repeats
    if num_layers % chunks:
        working = [r for r in range(1, num_layers // stages + 1) if num_layers % (stages * r) == 0]
        raise ValueError(
            f"A circular schedule with pp_size={stages} and pipeline_repeats={repeats} needs the layer count to "
            f"split into {chunks} equal chunks, but the model has {num_layers} layers; "
            + (f"pipeline_repeats {working} work with pp_size={stages}" if working
               else f"no pipeline_repeats splits {num_layers} layers over pp_size={stages}")
            + " (or use pipeline_schedule='gpipe').")
    size = num_layers // chunks
    return [(chunk * size, (chunk + 1) * size) for chunk in range(chunks)]


def check_pipeline_options(stages: int, microbatches: int | None, schedule: str, repeats: int) -> int:
    """The microbatch count M in force (default: one per stage), after checking the pipeline options."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline_schedule={schedule!r} is not a schedule; use one of {list(PIPELINE_SCHEDULES)}.")
    if stages == 1:
        if microbatches not in (None, 1) or repeats != 1 or schedule != "gpipe":
            raise ValueError("pipeline_microbatches / pipeline_schedule / pipeline_repeats apply with pp_size > 1; "
                             "this layout has pp_size=1.")
        return 1
    microbatches = stages if microbatches is None else microbatches
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"pipeline_microbatches={microbatches!r} must be a positive integer.")
    if schedule == "circular" and microbatches < stages:
        raise ValueError(
            f"pipeline_microbatches={microbatches} is below pp_size={stages}: a circular schedule feeds a "
            "microbatch back to the first stage for its next repeat, which needs at least one microbatch per "
            f"stage in flight; use pipeline_microbatches >= {stages}.")
    return microbatches
