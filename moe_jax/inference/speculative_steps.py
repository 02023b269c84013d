"""The scheduler's speculative decode steps (a part of `Scheduler`): each decoding request's drafts, the
verification step that checks them, and the tokens it keeps (the device side: `speculative`, step_programs.py's
"verify" programs)."""

from __future__ import annotations

from functools import partial

import numpy as np

from .requests import Request, RequestStatus, StepEvent
from .speculative import request_drafts


class SpeculativeSteps:
    """Drafts, verification steps and acceptance; the scheduler supplies config, counters, rows, inputs and
    `_emit`."""

    def _drafts(self, decoding: list[Request]) -> dict[str, list[int]]:
        """Each decoding request's drafts (none without speculation). Drafts are verified only in steps whose
        rows' logits are the model's alone (no bias, penalty, held stop ids or log probabilities: the
        verification program applies none of them)."""
        if not self.config.speculative or any(
                request.settings.controls_logits(len(request.output.generated_tokens)) for request in decoding):
            return {}
        return {request.request_id: request_drafts(request, self.config) for request in decoding}

    def _verify(self, decoding: list[Request], drafts: dict[str, list[int]]) -> list[StepEvent]:
        """One verification step: each decoding request's last token and its drafts in a row of 1 +
        `num_speculative_tokens` tokens (`decode_row_counts` rows per group) -> what each got: its accepted drafts
        and one token more."""
        per_group, rows = self._decode_rows(decoding)
        inputs = self._host_inputs(self.groups * per_group, 1 + self.config.num_speculative_tokens)
        for request in decoding:
            self._write_row(inputs, rows[request.request_id], request, partial(
                self._decode_row, inputs, rows[request.request_id], request, drafts[request.request_id]))
        decoding = [request for request in decoding if request.output.status != RequestStatus.FAILED]
        if not decoding:
            return []
        verified, *_ = step = self._run_step("verify", inputs)
        self.steps["verify"] += 1
        events = []
        for request in decoding:
            count, *tokens = verified[rows[request.request_id]]
            self.draft_tokens += len(drafts[request.request_id])
            self.accepted_draft_tokens += int(count) - 1
            # The row read its last token and the accepted drafts (the routing of the rejected ones is dropped).
            self._keep_routing(request, step, rows[request.request_id], int(count))
            events.append(self._emit_tokens(request, [int(token) for token in tokens[:count]]))
            self._keep_drafts(request, rows[request.request_id])
        return events

    def _keep_drafts(self, request: Request, row: int) -> None:
        """Drafting with MTP layers: `request` keeps its row's drafts of the step just run, for its next step."""
        if self.step_drafts is not None:
            request.drafts = [int(token) for token in self.step_drafts[row]]

    def _emit_tokens(self, request: Request, tokens: list[int]) -> StepEvent:
        """`_emit` each of a step's tokens for `request` in order, up to one that ends it -> one event."""
        emitted = []
        for token in tokens:
            event = self._emit(request, (np.asarray([token]), None), 0)
            emitted.append(token)
            if event.finished:
                break
        return StepEvent(request, emitted, event.finished, event.generated)

    @property
    def acceptance_rate(self) -> float:
        """Speculative drafts accepted / drafts verified (0 before any)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0
