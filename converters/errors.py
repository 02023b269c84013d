"""The two ways a checkpoint can be wrong, as exception types callers can catch apart.

`CheckpointFormatError`: the files themselves are unusable (corrupt header, truncated data, an index that
points outside the directory or at a missing shard). `CheckpointMismatchError`: the files are fine, but their
tensors do not fit the model (missing, unexpected, duplicated keys, wrong shapes or dtypes).
"""

from __future__ import annotations


class CheckpointFormatError(ValueError):
    """A checkpoint file or index cannot be read as safetensors; the message names the file and the fault."""


# Entries listed per kind of problem; a config that disagrees with the weights can give thousands.
SHOWN_PER_KIND = 8


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model's declared parameters.

    Raised once per load with every problem found, grouped by kind; the message lists the first
    `SHOWN_PER_KIND` of each kind, and the full lists are kept as attributes so tests and tools can inspect
    them without parsing the message.
    """

    def __init__(
        self,
        checkpoint: str,
        *,
        missing: list[str],
        unexpected: list[str],
        duplicated: list[str],
        shape_mismatches: list[str],
        dtype_mismatches: list[str],
    ):
        self.checkpoint = checkpoint
        self.missing = missing
        self.unexpected = unexpected
        self.duplicated = duplicated
        self.shape_mismatches = shape_mismatches
        self.dtype_mismatches = dtype_mismatches
        super().__init__(self._message())

    def _message(self) -> str:
        # Shapes first: a config that disagrees with the weights (a missing num_experts defaulting to 128)
        # shows there in a few lines, and is what the long missing/unexpected lists follow from.
        sections = [
            ("shape mismatch", self.shape_mismatches, "checkpoint shape differs from the declared one"),
            ("dtype mismatch", self.dtype_mismatches, "checkpoint dtype differs from the declared one"),
            ("missing", self.missing, "the model declares these parameters but the checkpoint lacks them"),
            ("unexpected", self.unexpected, "the checkpoint holds these keys but no parameter uses them"),
            ("duplicated", self.duplicated, "these parameters are given by more than one checkpoint layout"),
        ]
        lines = [f"Checkpoint {self.checkpoint} does not match the model:"]
        for title, entries, meaning in sections:
            if entries:
                lines.append(f"  {title} ({len(entries)}; {meaning}):")
                lines.extend(f"    {entry}" for entry in entries[:SHOWN_PER_KIND])
                if len(entries) > SHOWN_PER_KIND:
                    attribute = {"shape mismatch": "shape_mismatches", "dtype mismatch": "dtype_mismatches"}
                    lines.append(f"    ... and {len(entries) - SHOWN_PER_KIND} more (all of them: the "
                                 f"error's `{attribute.get(title, title)}` list)")
        if self.missing or self.unexpected or self.shape_mismatches:
            lines.append(
                "Fix: load with the key map of the checkpoint's architecture and a model config equal to the "
                "checkpoint's config.json."
            )
        if self.duplicated:
            lines.append("Fix: keep one layout per parameter (fused or per-expert) in the checkpoint.")
        if self.dtype_mismatches:
            lines.append("Fix: pass `dtype=` to cast on load, or declare the parameters in the checkpoint's dtype.")
        return "\n".join(lines)

    @property
    def has_problems(self) -> bool:
        return any(
            (self.missing, self.unexpected, self.duplicated, self.shape_mismatches, self.dtype_mismatches)
        )
