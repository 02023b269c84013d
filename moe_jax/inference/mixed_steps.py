"""The scheduler's mixed steps (a part of `Scheduler`): prompt pieces and every decoding slot's token in one
program, per data-parallel group its prompt rows then its slots (the device side: step_programs.py's "mixed"
programs)."""

from __future__ import annotations

from functools import partial

from .requests import Request, RequestStatus, StepEvent


class MixedSteps:
    """Mixed steps' rows; the scheduler supplies config, groups, the prompt pieces, the rows' writers and
    `_emit_decoded`."""

    def _mixed(self, prefilling: list[Request], decoding: list[Request]) -> list[StepEvent]:
        """One program for prompt pieces and a decode step: per group, prompt rows of `prefill_chunk` tokens (the
        fewest of `mixed_prompt_rows` that hold this step's pieces), then the group's slots (one token each) ->
        what each request got (prompts that finished prefilling: their first token; decoding requests: their
        next)."""
        pieces = self._prefill_pieces(prefilling)
        needed = max(len(group) for group in pieces)
        prompt_rows = next(rows for rows in self.mixed_prompt_rows if rows >= needed)
        stride = prompt_rows + self.config.max_slots // self.groups
        inputs = self._host_inputs(self.groups * stride, self.config.prefill_chunk)
        placed = self._place_prefill(inputs, pieces, stride)
        decode_rows = {request.request_id: self._mixed_decode_row(request.slot, prompt_rows) for request in decoding}
        for request in decoding:
            self._write_row(inputs, decode_rows[request.request_id], request,
                            partial(self._decode_row, inputs, decode_rows[request.request_id], request))
        decoding = [request for request in decoding if request.output.status != RequestStatus.FAILED]
        if not placed and not decoding:
            return []
        tokens = self._run_step("mixed", inputs)
        self.steps["mixed"] += 1
        events = self._prefilled(placed, tokens)
        return events + [self._emit_decoded(request, tokens, decode_rows[request.request_id]) for request in decoding]

    @property
    def mixed_prompt_rows(self) -> list[int]:
        """The prompt rows per group a mixed program may have: powers of two below `prefill_rows`, and it (a step
        whose pieces fill few rows runs a smaller program, not `prefill_rows` rows of padding)."""
        rows = self.config.prefill_rows
        return sorted({1 << i for i in range(rows.bit_length()) if 1 << i < rows} | {rows})

    def _mixed_decode_row(self, slot: int, prompt_rows: int) -> int:
        """The row of slot `slot` in a mixed step's inputs (each group's prompt rows come before its slots)."""
        per_group = self.config.max_slots // self.groups
        group, within = divmod(slot, per_group)
        return group * (prompt_rows + per_group) + prompt_rows + within
