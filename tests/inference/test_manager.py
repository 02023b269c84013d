"""`ContinuousBatchingManager` under load: incremental outputs that add up to the request's tokens, a bounded queue,
a queue timeout, a drain, and a request whose own inputs fail a step failing alone (the engine goes on)."""

from __future__ import annotations

import time

import jax
import pytest

from moe_jax import AutoModelForCausalLM
from moe_jax.inference import RequestStatus
from moe_jax.inference.manager import QueueFull

from .hf_generation import MODELS, NEW_TOKENS
from .test_continuous import fixture_prompts

FLAGS = dict(max_slots=2, page_size=4, max_model_len=64, prefill_chunk=3)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(MODELS / "qwen3_moe", devices=jax.devices()[:1], progress=False)


def collect(manager, request_ids, timeout=60.0) -> dict:
    """Every output each request's handler received, once all of them finished."""
    deadline = time.monotonic() + timeout
    for request_id in request_ids:
        while not (manager.handled[request_id] and manager.handled[request_id][-1].is_finished()):
            assert time.monotonic() < deadline, f"{request_id} did not finish"
            time.sleep(0.005)
    return {request_id: manager.handled[request_id] for request_id in request_ids}


def with_handlers(manager):
    """-> add(prompt, **options): queues a request (ids h0, h1, ...) whose outputs go to manager.handled[id]."""
    manager.handled = {}

    def add(prompt, **options):
        request_id = f"h{len(manager.handled)}"
        manager.handled[request_id] = []
        return manager.add_request(prompt, request_id=request_id, handler=manager.handled[request_id].append,
                                   **options)

    return add


# heavy: the server streams incremental outputs, and its streamed text equals generate's
# (tests/serving/test_server.py)
@pytest.mark.heavy
def test_incremental_outputs_carry_only_new_tokens_and_add_up_to_generates(model):
    prompts, greedy, _ = fixture_prompts("qwen3_moe")
    with model.init_continuous_batching(**FLAGS) as manager:
        add = with_handlers(manager)
        ids = [add(prompt, max_new_tokens=NEW_TOKENS, streaming=True, incremental=True) for prompt in prompts[:2]]
        outputs = collect(manager, ids)
    for row, request_id in enumerate(ids):
        *partial, final = outputs[request_id]
        assert final.generated_tokens == list(greedy[row]) and final.offset == 0
        assert all(len(o.generated_tokens) <= 2 for o in partial)   # one token (two when prefill and decode meet)
        joined = []
        for output in partial:
            assert output.offset == len(joined)   # each starts where the previous ended
            joined += output.generated_tokens
        assert joined == list(greedy[row][:len(joined)]) and len(joined) >= NEW_TOKENS - 1


def test_beyond_max_queued_add_request_raises_queue_full(model):
    prompts, _, _ = fixture_prompts("qwen3_moe")
    manager = model.init_continuous_batching(**FLAGS, max_queued=2)   # not started: every request waits
    manager.add_request(prompts[0], max_new_tokens=4)
    manager.add_request(prompts[1], max_new_tokens=4)
    with pytest.raises(QueueFull, match="2 requests are waiting"):
        manager.add_request(prompts[2], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_queued=-1"):
        model.init_continuous_batching(**FLAGS, max_queued=-1)


def test_a_request_waiting_past_the_queue_timeout_fails_with_its_reason(model):
    prompts, _, _ = fixture_prompts("qwen3_moe")
    manager = model.init_continuous_batching(**FLAGS, queue_timeout=0.05)
    add = with_handlers(manager)
    late = add(prompts[0], max_new_tokens=4)
    time.sleep(0.1)   # waited before the engine even started
    with manager:
        (output,) = collect(manager, [late])[late]
    assert (output.status, output.finish_reason) == (RequestStatus.FAILED, "queue_timeout")
    assert "waited more than 0.05 s" in output.error


def test_a_drain_refuses_new_requests_ends_waiting_ones_and_cuts_running_ones_at_its_deadline(model):
    prompts, _, _ = fixture_prompts("qwen3_moe")
    with model.init_continuous_batching(**FLAGS) as manager:
        add = with_handlers(manager)
        running = [add(prompt, max_new_tokens=60, streaming=True, incremental=True) for prompt in prompts[:2]]
        waiting = add(prompts[2], max_new_tokens=4)
        while manager.engine.slots_in_use < 2:
            time.sleep(0.005)
        manager.begin_drain(0.0)
        manager.begin_drain(30.0)   # a later, longer drain (the server's shutdown hook after a second signal)
        with pytest.raises(RuntimeError, match="stopping"):
            manager.add_request(prompts[0], max_new_tokens=4)
        outputs = collect(manager, running + [waiting])
    finals = [outputs[request_id][-1] for request_id in running + [waiting]]
    assert all((o.status, o.finish_reason) == (RequestStatus.FAILED, "shutdown") for o in finals)
    assert "did not start" in finals[2].error and "drain time" in finals[0].error
    assert manager.engine.book.free_pages() == manager.engine.book.total_pages


def test_a_request_whose_inputs_fail_a_step_fails_alone(model, monkeypatch):
    prompts, greedy, _ = fixture_prompts("qwen3_moe")
    with model.init_continuous_batching(**FLAGS) as manager:
        decode_row = manager.engine._decode_row

        def poisoned(inputs, row, request):
            if request.request_id == "h1":
                raise OverflowError("out of bounds for int32")
            decode_row(inputs, row, request)

        monkeypatch.setattr(manager.engine, "_decode_row", poisoned)
        add = with_handlers(manager)
        ids = [add(prompt, max_new_tokens=NEW_TOKENS) for prompt in prompts[:2]]
        outputs = collect(manager, ids)
        assert manager.is_running() and manager.error is None
    good, bad = outputs["h0"][-1], outputs["h1"][-1]
    assert good.generated_tokens == list(greedy[0]) and good.status == RequestStatus.FINISHED
    assert (bad.status, bad.finish_reason) == (RequestStatus.FAILED, "error") and "int32" in bad.error
    assert manager.engine.book.free_pages() == manager.engine.book.total_pages
