"""The engine's host side alone (`Scheduler`), driven by a fake step: admission, pages, chunked prefill, decode
packing, the rows' inputs and the stop conditions, with no model and no compiled program."""

from __future__ import annotations

import numpy as np
import pytest

from moe_jax.inference.requests import ContinuousBatchingConfig, Request, RequestSettings, RequestStatus
from moe_jax.inference.scheduler import Scheduler

VOCAB = 50


class FakeStep:
    """Each row's next id is its last real token + 1 (mod VOCAB); every call's kind and inputs are kept."""

    def __init__(self):
        self.calls: list[tuple[str, dict[str, np.ndarray]]] = []

    def __call__(self, kind: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
        self.calls.append((kind, {name: values.copy() for name, values in inputs.items()}))
        last = np.maximum(inputs["mask"].sum(axis=1) - 1, 0)
        return (inputs["ids"][np.arange(len(last)), last] + 1) % VOCAB


def scheduler(step: FakeStep, groups: int = 1, decode=None, **config) -> Scheduler:
    return Scheduler(ContinuousBatchingConfig(**config), groups=groups, vocab_size=VOCAB, run=step, decode=decode)


def run_all(engine: Scheduler) -> dict[str, list]:
    events: dict[str, list] = {}
    while engine.has_work():
        for event in engine.step():
            events.setdefault(event.request.request_id, []).append(event)
    return events


def test_tokens_follow_the_step_and_every_page_returns():
    step = FakeStep()
    engine = scheduler(step, max_slots=2, page_size=4, max_model_len=16, prefill_chunk=8)
    requests = [Request(f"r{i}", [i + 1, i + 2, i + 3], RequestSettings(max_new_tokens=4)) for i in range(3)]
    for request in requests:
        engine.add(request)
    run_all(engine)
    for i, request in enumerate(requests):
        assert request.output.generated_tokens == [i + 4, i + 5, i + 6, i + 7]
        assert (request.output.status, request.output.finish_reason) == (RequestStatus.FINISHED, "length")
    assert engine.book.free_pages() == engine.book.total_pages and engine.slots_in_use == 0


def test_admission_is_first_come_first_served_and_waits_for_pages():
    step = FakeStep()
    # 4 pages of 4 tokens: the first request needs 3 (3 + 8 tokens), so the second (2 pages) must wait for them.
    engine = scheduler(step, max_slots=2, page_size=4, max_model_len=16, num_pages=4)
    first = Request("first", [1, 2, 3], RequestSettings(max_new_tokens=8))
    second = Request("second", [5, 6], RequestSettings(max_new_tokens=5))
    engine.add(first)
    engine.add(second)
    engine.step()
    assert first.slot == 0 and len(first.pages) == 3 and second.slot is None and list(engine.waiting) == [second]
    while first.output.status != RequestStatus.FINISHED:
        engine.step()
    engine.step()
    assert second.slot is not None and len(second.pages) == 2


def test_a_prompt_is_prefilled_in_chunks_and_its_first_token_comes_from_its_last():
    step = FakeStep()
    engine = scheduler(step, max_slots=1, page_size=4, max_model_len=32, prefill_chunk=4, mixed_steps=False)
    prompt = list(range(1, 11))                                   # 10 tokens: pieces of 4, 4 and 2
    request = Request("a", prompt, RequestSettings(max_new_tokens=2))
    engine.add(request)
    run_all(engine)
    prefills = [inputs for kind, inputs in step.calls if kind == "prefill"]
    assert [int(inputs["lengths"][0]) for inputs in prefills] == [0, 4, 8]
    assert [int(inputs["mask"][0].sum()) for inputs in prefills] == [4, 4, 2]
    assert list(prefills[2]["ids"][0]) == [9, 10, 0, 0]
    assert request.output.generated_tokens == [11, 12]
    decodes = [inputs for kind, inputs in step.calls if kind == "decode"]
    # The decode row stores the previous token at its index and draws the request's second token.
    assert int(decodes[0]["lengths"][0]) == 10 and int(decodes[0]["counters"][0]) == 1


def test_mixed_steps_put_prompt_rows_before_each_groups_slots():
    step = FakeStep()
    engine = scheduler(step, groups=2, max_slots=4, page_size=4, max_model_len=32, prefill_chunk=4)
    long = Request("long", list(range(1, 9)), RequestSettings(max_new_tokens=3))   # two chunks
    engine.add(long)
    engine.step()                                           # its first chunk; it took group 1 (ties: the last)
    short = Request("short", [7], RequestSettings(max_new_tokens=3))
    engine.add(short)                                       # group 0: more free pages
    engine.step()
    assert (long.group, short.group) == (1, 0)
    kind, inputs = step.calls[-1]
    assert kind == "mixed" and inputs["ids"].shape == (2 * (1 + 2), 4)       # per group: 1 prompt row + 2 slots
    assert list(inputs["ids"][0]) == [7, 0, 0, 0] and list(inputs["ids"][3]) == [5, 6, 7, 8]
    assert list(inputs["lengths"][[0, 3]]) == [0, 4]


def test_decode_rows_pack_into_the_smallest_program():
    step = FakeStep()
    engine = scheduler(step, max_slots=16, page_size=4, max_model_len=16, decode_rows=(2, 4), prefill_rows=4)
    assert engine.decode_row_counts == [2, 4, 16]
    for i in range(3):
        engine.add(Request(f"r{i}", [i + 1], RequestSettings(max_new_tokens=3)))
    run_all(engine)
    assert {inputs["ids"].shape for kind, inputs in step.calls if kind == "decode"} == {(4, 1)}


def test_a_stop_string_ends_a_request_with_the_text_that_ends_it():
    step = FakeStep()
    decode = lambda ids: "".join(chr(ord("a") + i % 26) for i in ids)  # noqa: E731
    engine = scheduler(step, decode=decode, max_slots=1, page_size=4, max_model_len=32)
    request = Request("a", [0], RequestSettings(max_new_tokens=10, stop=("de",)))   # tokens 1, 2, 3, ... = b c d e
    engine.add(request)
    run_all(engine)
    assert request.output.generated_tokens == [1, 2, 3, 4] and request.output.finish_reason == "stop"


def test_eos_and_the_context_end_requests():
    step = FakeStep()
    engine = scheduler(step, max_slots=2, page_size=4, max_model_len=8)
    eos = Request("eos", [1], RequestSettings(max_new_tokens=10, eos_token_id=(3,)))
    context = Request("context", [10, 11, 12, 13, 14], RequestSettings(max_new_tokens=10))
    engine.add(eos)
    engine.add(context)
    run_all(engine)
    assert eos.output.generated_tokens == [2, 3] and eos.output.finish_reason == "stop"
    assert context.output.generated_tokens == [15, 16, 17] and context.output.finish_reason == "length"


def test_a_request_whose_row_fails_fails_alone(monkeypatch):
    step = FakeStep()
    engine = scheduler(step, max_slots=2, page_size=4, max_model_len=16)
    decode_row = engine._decode_row

    def poisoned(inputs, row, request):
        if request.request_id == "bad":
            raise OverflowError("out of bounds for int32")
        decode_row(inputs, row, request)

    monkeypatch.setattr(engine, "_decode_row", poisoned)
    good, bad = (Request(name, [4], RequestSettings(max_new_tokens=3)) for name in ("good", "bad"))
    engine.add(good)
    engine.add(bad)
    run_all(engine)
    assert good.output.generated_tokens == [5, 6, 7]
    assert (bad.output.status, bad.output.finish_reason) == (RequestStatus.FAILED, "error")
    assert "int32" in bad.output.error and engine.book.free_pages() == engine.book.total_pages
    # Its row was idle in every decode step it would have been in.
    assert all(inputs["mask"].sum() == 1 for kind, inputs in step.calls if kind == "decode")


def test_bad_configurations_and_requests_are_refused_by_name():
    step = FakeStep()
    with pytest.raises(ValueError, match="max_slots=3 must be a positive multiple of the layout's 2"):
        scheduler(step, groups=2, max_slots=3)
    with pytest.raises(ValueError, match="num_pages=2 must be"):
        scheduler(step, max_slots=1, page_size=4, max_model_len=16, num_pages=2)
    engine = scheduler(step, max_slots=1, page_size=4, max_model_len=8)
    with pytest.raises(ValueError, match="context \\(max_model_len\\) is 8"):
        engine.add(Request("long", list(range(8))))
    with pytest.raises(ValueError, match=f"in \\[0, {VOCAB}\\)"):
        engine.add(Request("vocab", [VOCAB]))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add(Request("stop", [1], RequestSettings(stop=("x",))))


def test_prompts_are_prefilled_in_admission_order_not_slot_order():
    """A prompt admitted into a high slot is prefilled before a later one that took a lower slot freed meanwhile."""
    step = FakeStep()
    engine = scheduler(step, max_slots=2, page_size=4, max_model_len=64, prefill_chunk=4)
    short = Request("short", [1, 2], RequestSettings(max_new_tokens=1))
    long = Request("long", list(range(1, 21)), RequestSettings(max_new_tokens=1))
    engine.add(short)
    engine.add(long)
    engine.step()                                            # short (slot 0) done; long (slot 1) waits
    assert short.output.is_finished() and long.slot == 1
    later = Request("later", list(range(30, 50)), RequestSettings(max_new_tokens=1))
    engine.add(later)                                        # takes slot 0
    engine.step()
    assert later.slot == 0 and long.prefilled == 4 and later.prefilled == 0


class RoutingStep(FakeStep):
    """FakeStep whose steps also record routing: each token's "expert id" is the token itself (L = K = 1)."""

    def __call__(self, kind: str, inputs: dict[str, np.ndarray]):
        new_ids = super().__call__(kind, inputs)
        return new_ids, None, inputs["ids"][:, :, None, None] if inputs["routing"].any() else None


def test_recorded_routing_holds_every_read_token_in_order_and_minus_one_for_the_last():
    step = RoutingStep()
    engine = scheduler(step, max_slots=2, page_size=4, max_model_len=32, prefill_chunk=3)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    engine.add(Request("plain", prompt, RequestSettings(max_new_tokens=2)))
    run_all(engine)
    recording = Request("recording", prompt, RequestSettings(max_new_tokens=6, eos_token_id=(14,),
                                                              return_routing=True))
    engine.add(recording)
    run_all(engine)
    output = recording.output
    assert output.generated_tokens == [11, 12, 13, 14] and output.cached_tokens == 0   # never from the cache
    np.testing.assert_array_equal(output.routing[0, :, 0], prompt + [11, 12, 13, -1])
    assert output.routing.shape == (1, 14, 1)
    assert [kind for kind, inputs in step.calls if inputs["routing"].any()] == ["mixed"] * 4 + ["decode"] * 3
