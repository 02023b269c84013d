"""The scheduler's side of routing recording (a part of `Scheduler`): each step's expert ids kept for the requests
that record them (`RequestSettings.return_routing`), and their `GenerationOutput.routing` once they end (the
device side: step_programs.py's routing variants).

A recording request's rows of a step hand over the expert ids of the tokens they feed: a prompt piece's tokens,
a decode row's input (the token generated before it), a verification row's input and its accepted drafts (its
rejected drafts' are dropped). Concatenated in step order, they are the ids of every token the model read, in
sequence order: the request's prompt is never taken from the prefix cache (`PrefixCache.reusable`), so every
prompt token is read.
"""

from __future__ import annotations

import numpy as np

from .requests import Request, StepEvent


class RoutingSteps:
    """Keeping and assembling recorded routing; the scheduler supplies `_emit` and calls these."""

    @staticmethod
    def _keep_routing(request: Request, step: tuple, row: int, count: int) -> None:
        """`request` read the first `count` tokens of row `row` of the step whose result is `step` (new ids, log
        probabilities, routing [rows, tokens, L, K] or None): keep their expert ids if it records them."""
        if request.settings.return_routing and step[2] is not None:
            request.routing.append(step[2][row, :count])

    def _emit_decoded(self, request: Request, step: tuple, row: int) -> StepEvent:
        """A decode row's result: its input token's routing kept, then its new token (`_emit`)."""
        self._keep_routing(request, step, row, 1)
        return self._emit(request, step, row)

    @staticmethod
    def _close_routing(request: Request) -> None:
        """An ending request's routing -> `GenerationOutput.routing` [L, N, K] over its N tokens (prompt then
        generated): the recorded rows of the tokens it read (all but the last), -1 where none was recorded."""
        if not request.settings.return_routing or not request.routing:
            return
        output = request.output
        total = len(output.prompt_ids) + len(output.generated_tokens)
        read = np.concatenate(request.routing)[:max(total - 1, 0)]             # [tokens read, L, K]
        routing = np.full((total, *read.shape[1:]), -1, read.dtype)
        routing[:len(read)] = read
        output.routing = np.ascontiguousarray(routing.swapaxes(0, 1))
        request.routing = []
