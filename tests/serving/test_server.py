"""`moe_jax.serving` and `moe-jax serve`: a live server on 127.0.0.1 driven by the official OpenAI client (and
raw HTTP for errors, metrics and disconnects), over a tiny random checkpoint with a byte-level tokenizer and a
chat template. The random model's bytes are often not UTF-8, so the streamed text exercises held-back
incomplete characters.

One server (uvicorn in a thread, the model on tp=2 ep=2 fsdp=2; tests/serving/live.py) serves most tests; one
test runs the real command in a subprocess (one device) and stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("jinja2", reason="chat templates are rendered with jinja2")

import jax  # noqa: E402

from moe_jax import AutoModelForCausalLM, DistributedConfig  # noqa: E402
from moe_jax.serving import build_app  # noqa: E402
from moe_jax.tokenization import CheckpointTokenizer, load_checkpoint_tokenizer  # noqa: E402

from .live import MAX_MODEL_LEN, NAME, SERVER_FLAGS, free_socket, serve_command, serving, write_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def served(checkpoint):
    tokenizer = load_checkpoint_tokenizer(checkpoint, instead="-")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, DistributedConfig(tp_size=2, ep_size=2, fsdp_size=2),
                                                 devices=jax.devices()[:4], progress=False)
    manager = model.init_continuous_batching(decode=tokenizer.decode, **SERVER_FLAGS)
    with serving(model, manager, tokenizer) as served:
        yield served
    assert not manager.is_running()   # the lifespan's shutdown stopped the engine


def test_completions_greedy_text_equals_generate_plain_and_streamed(served):
    prompt = "Hello"
    ids = served.tokenizer.encode(prompt)
    expected = served.greedy(ids, 12)
    assert "\ufffd" in expected   # the random model's bytes: incomplete characters in the stream
    response = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason) == (expected, "length")
    assert response.id.startswith("cmpl-") and response.object == "text_completion" and response.model == NAME
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (
        len(ids), 12, len(ids) + 12)
    # The prompt as token ids, streamed: the same text, in deltas that never end in half a character.
    chunks = list(served.client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert "".join(texts) == expected
    assert all(not text.endswith("\ufffd") for text in texts[:-2])
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_applies_the_template_plain_and_streamed(served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = served.tokenizer.apply_chat_template(messages)
    assert served.tokenizer.decode(ids) == "<system>Be brief.\n<user>Hi there\n<assistant>"
    expected = served.greedy(ids, 8)
    response = served.client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=8,
                                                     temperature=0)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    message = response.choices[0].message
    assert (message.role, message.content, response.choices[0].finish_reason) == ("assistant", expected, "length")
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), 8)
    chunks = list(served.client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                                        stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].object == "chat.completion.chunk"


def test_a_stop_string_ends_the_text_before_it(served):
    prompt = "The end"
    full = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    # Two characters of the greedy text (no replacement character) from its fourth on: often two tokens apart.
    start = next(i for i in range(3, len(full) - 1) if "\ufffd" not in full[i:i + 2])
    stop = full[start:start + 2]
    expected = full[:full.find(stop)]
    response = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                                stop=[stop, "never seen"])
    assert (response.choices[0].text, response.choices[0].finish_reason) == (expected, "stop")
    assert response.usage.completion_tokens < 24
    chunks = list(served.client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                                   stop=stop, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_concurrent_requests_share_the_batch_and_each_get_their_own_text(served):
    prompts = ["one", "two", "three", "four!"]

    def complete(prompt, stream=False):
        kwargs = dict(model=NAME, prompt=prompt, max_tokens=6, temperature=0)
        if stream:
            return "".join(chunk.choices[0].text for chunk in served.client.completions.create(**kwargs, stream=True))
        return served.client.completions.create(**kwargs).choices[0].text

    alone = [complete(prompt) for prompt in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(complete, prompts, [True, False] * 2))
    assert together == alone


def test_sampling_is_reproducible_by_seed(served):
    def sample(seed):
        return served.client.completions.create(model=NAME, prompt="abc", max_tokens=10, temperature=0.8, top_p=0.9,
                                                seed=seed, extra_body={"top_k": 20}).choices[0].text

    assert sample(3) == sample(3)


def test_bad_requests_are_openai_errors(served):
    def post(path, **kwargs):
        response = httpx.post(f"{served.url}{path}", **kwargs)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return response.status_code, error

    status, error = post("/v1/completions", content=b'{"prompt": "a", ', headers={"content-type": "application/json"})
    assert status == 400 and "not valid JSON" in error["message"] and error["type"] == "invalid_request_error"
    status, error = post("/v1/completions", json={"model": "gpt-4", "prompt": "a"})
    assert (status, error["code"], error["param"]) == (404, "model_not_found", "model")
    status, error = post("/v1/completions", json={"prompt": "x" * MAX_MODEL_LEN})
    assert (status, error["code"]) == (400, "context_length_exceeded") and "256 tokens" in error["message"]
    status, error = post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 300}]})
    assert (status, error["code"]) == (400, "context_length_exceeded")
    invalid = {"max_tokens": 0, "temperature": -0.5, "top_p": 1.5, "n": 17, "best_of": 2, "prompt": ["a", "b"],
               "stop": [""], "top_k": -2, "stream": "maybe"}
    for param, value in invalid.items():
        status, error = post("/v1/completions", json={"prompt": "a"} | {param: value})
        assert (status, error["param"]) == (400, param), (param, error)
    for body in ({"prompt": [1, 2, 300]}, {"prompt": ""}, {"prompt": 5}, [1, 2], {"messages": []}):
        assert post("/v1/completions", json=body)[0] == 400
    assert post("/v1/chat/completions", json={"messages": []})[0] == 400
    assert post("/v1/chat/completions", json={"messages": [{"content": "no role"}]})[1]["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="other", prompt="a", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="not supported"):
        served.client.completions.create(model=NAME, prompt="a", n=2, best_of=3)


def test_chat_without_a_template_is_a_400(served):
    """A tokenizer without a chat template (as a tokenizers-only install reads one): checked before the manager
    sees the request, so an app over the running manager is asked in-process, without starting it."""
    tokenizer = CheckpointTokenizer(encode=served.tokenizer.encode, decode=served.tokenizer.decode)
    app = build_app(served.manager, tokenizer, model_name=NAME, max_model_len=MAX_MODEL_LEN)

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})

    response = asyncio.run(ask())
    assert response.status_code == 400 and "no chat template" in response.json()["error"]["message"]


def test_health_models_and_metrics(served):
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
    assert [model.id for model in served.client.models.list()] == [NAME]
    assert served.client.models.retrieve(NAME).id == NAME
    served.client.completions.create(model=NAME, prompt="count me", max_tokens=3, temperature=0)
    metrics = served.metrics()
    assert metrics["moe_jax_slots_total"] == 4 and metrics["moe_jax_slots_in_use"] == 0
    assert metrics["moe_jax_pages_free"] == metrics["moe_jax_pages_total"] == 4 * MAX_MODEL_LEN // 8
    assert metrics["moe_jax_requests_finished_total"] >= 1 and metrics["moe_jax_generated_tokens_total"] >= 3
    assert metrics["moe_jax_time_to_first_token_seconds_count"] >= 1
    assert metrics["moe_jax_inter_token_latency_seconds_count"] >= 2
    compiled = served.manager.engine.compiled_shapes
    assert metrics["moe_jax_compiled_programs"] == len(compiled) and {entry[0] for entry in compiled} == {
        "mixed", "decode"}
    assert metrics["moe_jax_mixed_steps_total"] >= 1 and metrics["moe_jax_prefill_steps_total"] == 0


def wait_idle(served, timeout=30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = served.metrics()
        if metrics["moe_jax_slots_in_use"] == 0 and metrics["moe_jax_pages_free"] == metrics["moe_jax_pages_total"]:
            return metrics
        assert time.monotonic() < deadline, f"the server did not free its slots and pages: {metrics}"
        time.sleep(0.05)


def test_a_client_that_goes_away_frees_its_slot_and_pages(served, monkeypatch):
    cancelled = []
    original = served.manager.cancel_request
    monkeypatch.setattr(served.manager, "cancel_request", lambda request_id: (cancelled.append(request_id),
                                                                             original(request_id)))
    # Steps of 20 ms at least: the requests cannot finish before their clients leave.
    step = served.manager.engine.step
    monkeypatch.setattr(served.manager.engine, "step", lambda: (time.sleep(0.02), step())[1])
    before = wait_idle(served)["moe_jax_generated_tokens_total"]
    asked = 100
    body = {"prompt": "stream me", "max_tokens": asked, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ") and next(lines) == "" and next(lines).startswith("data: ")
    # A plain request whose client gives up (read timeout) is cancelled too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v1/completions", json=body | {"stream": False}, timeout=httpx.Timeout(30, read=0.3))
    after = wait_idle(served)
    assert len(cancelled) == 2 and all(request_id.startswith("cmpl-") for request_id in cancelled)
    assert after["moe_jax_generated_tokens_total"] - before < asked
    response = served.client.completions.create(model=NAME, prompt="still here", max_tokens=2, temperature=0)
    assert response.usage.completion_tokens == 2


# heavy: many clients; one leaving mid-stream is the suite's
@pytest.mark.heavy
def test_200_requests_with_10_percent_of_clients_leaving_mid_stream(served):
    """The issue's fault test: random prompt and output lengths, 16 clients at a time, every tenth client reads
    one chunk and disconnects. Every completed response equals `generate`'s greedy text for its prompt, the
    page pool comes back fully free, and the server still answers."""
    rng = np.random.default_rng(1)
    requests = [dict(prompt=[int(t) for t in rng.integers(1, 256, int(rng.integers(1, 40)))],
                     max_tokens=int(rng.integers(1, 17)), stream=bool(i % 2), leaves=i % 10 == 3)
                for i in range(200)]
    kept = [r for r in requests if not r["leaves"]]
    width = max(len(r["prompt"]) for r in kept)
    ids, mask = np.zeros((len(kept), width), np.int32), np.zeros((len(kept), width), np.int32)
    for row, r in enumerate(kept):
        ids[row, width - len(r["prompt"]):], mask[row, width - len(r["prompt"]):] = r["prompt"], 1
    eos = set(served.manager.generation_config.eos_token_id)
    generated = served.model.generate(ids, mask, max_new_tokens=16)[:, width:]
    for r, row in zip(kept, generated):
        tokens = row[:r["max_tokens"]].tolist()
        ended = [i for i, t in enumerate(tokens) if t in eos]
        r["expected"] = served.tokenizer.decode(tokens[:ended[0] + 1] if ended else tokens)

    def client(r) -> str | None:
        body = {"model": NAME, "prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0,
                "stream": r["stream"] or r["leaves"]}
        if not body["stream"]:
            return httpx.post(f"{served.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        text = ""
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if r["leaves"] and line.startswith("data: "):
                    return None                                    # gone after the first chunk
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += "".join(choice["text"] for choice in json.loads(line[6:])["choices"])
        return text

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(client, requests))
    assert [text for r, text in zip(requests, texts) if not r["leaves"]] == [r["expected"] for r in kept]
    after = wait_idle(served)
    assert after["moe_jax_pages_free"] == after["moe_jax_pages_total"] and after["moe_jax_slots_in_use"] == 0
    response = served.client.completions.create(model=NAME, prompt="still here", max_tokens=2, temperature=0)
    assert response.usage.completion_tokens == 2


# heavy: the suite's real command (tests/serving/test_server_limits.py) reports its programs, answers and drains
@pytest.mark.heavy
def test_the_serve_command_listens_answers_and_stops_on_sigterm(checkpoint):
    with serve_command(checkpoint, "--max-slots", "2", "--page-size", "16", "--max-model-len", "32",
                       "--prefill-chunk", "16", "--log-level", "warning") as (process, lines):
        started = lines[-1] if lines else ""
        assert started.startswith("serving tiny at http://127.0.0.1:"), "".join(lines)
        assert "tp=1 fsdp=1 ep=1" in started and "2 slots" in started and "4 pages of 16 tokens" in started
        # A line for each program as it compiles, then the ready line with the URL.
        compiling = [line for line in lines if line.startswith("compiling program ")]
        assert len(compiling) == 6 and "6 programs compiled" in started
        assert [line.split(":")[0] for line in compiling] == [f"compiling program {i} of 6" for i in range(1, 7)]
        assert re.fullmatch(r"compiling program 1 of 6: mixed \[3 x 16\] width 1 \.\.\. \d+\.\d s\n", compiling[0])
        assert any("decode [2 x 1] width 2" in line for line in compiling)
        url = re.search(r"(http://\S+/v1)", started).group(1)
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        response = client.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0)
        assert response.usage.completion_tokens == 4 and response.choices[0].finish_reason == "length"
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        # Stopped after the engine drained (the warm-up requests count too).
        assert re.search(r"stopped: \d+ requests finished", process.stderr.read())


def test_serve_refuses_what_it_cannot_do(checkpoint, capsys, monkeypatch):
    from moe_jax.cli import main

    assert main(["serve", "--model", str(checkpoint), "--max-request-bytes", "0"]) == 2
    assert "error: --max-request-bytes 0 must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--model", str(checkpoint), "--queue-timeout", "-1"]) == 2
    assert "--queue-timeout -1.0 must be a positive number of seconds" in capsys.readouterr().err
    assert main(["serve", "--model", str(checkpoint), "--max-model-len", "1000"]) == 2
    assert "must be in [2, 256]" in capsys.readouterr().err
    assert main(["serve", "--model", str(checkpoint), "--max-slots", "4", "--decode-rows", "1,8"]) == 2
    assert "--decode-rows 1,8: each must be in [1, --max-slots 4]" in capsys.readouterr().err
    # Settings that would open the server wider than asked: one `error:` line each, exit 2, before loading.
    monkeypatch.delenv("MOE_JAX_API_KEY", raising=False)
    assert main(["serve", "--model", str(checkpoint), "--allowed-origins", "*"]) == 2
    assert capsys.readouterr().err.startswith("error: --allowed-origins '*' lets any web page call the server")
    assert main(["serve", "--model", str(checkpoint), "--api-key", " "]) == 2
    assert capsys.readouterr().err.startswith("error: --api-key is empty")
    monkeypatch.setenv("MOE_JAX_API_KEY", "")
    assert main(["serve", "--model", str(checkpoint), "--allowed-origins", "*"]) == 2
    assert capsys.readouterr().err.count("error:") == 1   # the empty key, said once
    monkeypatch.delenv("MOE_JAX_API_KEY")
    taken = free_socket()
    taken.listen()
    try:
        assert main(["serve", "--model", str(checkpoint), "--port", str(taken.getsockname()[1])]) == 2
        assert f"error: cannot listen on 127.0.0.1:{taken.getsockname()[1]}" in capsys.readouterr().err
    finally:
        taken.close()
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else find_spec(name, *a))
    assert main(["serve", "--model", str(checkpoint)]) == 2
    assert 'pip install "moe_jax[serve]"' in capsys.readouterr().err


# ---- hostile requests: each is refused alone, and the engine goes on -----------------------------------------------
HOSTILE_BODIES = {
    "a 5,000-digit integer": b'{"prompt": "hi", "max_tokens": 4, "seed": ' + b"7" * 5000 + b"}",
    "a lone surrogate": b'{"prompt": "a\\ud800b", "max_tokens": 4}',
    "top_k 2^31": b'{"prompt": "hi", "max_tokens": 4, "top_k": 2147483648}',
    "top_k beyond the vocabulary": b'{"prompt": "hi", "max_tokens": 4, "top_k": 257}',
    "NaN temperature": b'{"prompt": "hi", "max_tokens": 4, "temperature": NaN}',
    "1,000 stop strings": json.dumps({"prompt": "hi", "stop": ["s" * 1000] * 1000}).encode(),
    "logprobs beyond 20": b'{"prompt": "hi", "logprobs": 21}',
    "a chat message with a lone surrogate": b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
}


def baseline(served) -> str:
    """The suite's greedy baseline: the same text before and after every hostile request."""
    return served.client.completions.create(model=NAME, prompt="Baseline", max_tokens=8, temperature=0).choices[0].text


@pytest.mark.parametrize("what", list(HOSTILE_BODIES))
def test_a_hostile_request_is_a_400_and_the_next_greedy_completion_is_unchanged(served, what):
    before = baseline(served)
    path = "/v1/chat/completions" if b"messages" in HOSTILE_BODIES[what] else "/v1/completions"
    response = httpx.post(f"{served.url}{path}", content=HOSTILE_BODIES[what],
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400, (what, response.text)
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
    assert baseline(served) == before


def test_a_temperature_of_1e_40_is_greedy(served):
    expected = baseline(served)
    response = served.client.completions.create(model=NAME, prompt="Baseline", max_tokens=8, temperature=1e-40)
    assert response.choices[0].text == expected


def test_a_1mb_prompt_is_refused_before_tokenizing_without_stalling_a_stream(served):
    """The largest gap between a running stream's chunks stays under a second while 1 MB prompts arrive."""
    arrivals: list[float] = []
    body = {"model": NAME, "prompt": "stream on", "max_tokens": 120, "temperature": 0, "stream": True}
    served.client.completions.create(**body | {"stream": False})   # its programs compiled: no gap but the prompts'

    def stream():
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())

    streaming = threading.Thread(target=stream)
    streaming.start()
    while len(arrivals) < 3:
        time.sleep(0.01)
    huge = {"model": NAME, "prompt": "x" * (1 << 20), "max_tokens": 4}
    statuses = []
    for _ in range(3):
        started = time.monotonic()
        response = httpx.post(f"{served.url}/v1/completions", json=huge, timeout=30)
        statuses.append((response.status_code, response.json()["error"]["code"], time.monotonic() - started < 1))
    streaming.join(60)
    assert statuses == [(400, "context_length_exceeded", True)] * 3
    gaps = np.diff(arrivals)
    assert len(arrivals) > 50 and gaps.max() < 1.0, gaps.max()


def test_a_20mb_body_is_413_within_a_second(served):
    started = time.monotonic()
    response = httpx.post(f"{served.url}/v1/completions", content=b"x" * (20 << 20),
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert time.monotonic() - started < 1.0
    assert baseline(served) == baseline(served)


def test_a_request_whose_inputs_break_a_step_fails_alone(served, monkeypatch):
    """Its slot and pages are freed, its client gets a 500 naming the failure (no exception class), the
    requests batched with it finish with their own text, and the engine goes on."""
    expected = baseline(served)
    engine = served.manager.engine
    decode_row = engine._decode_row

    def poisoned(inputs, row, request):
        if request.settings.seed == 666:
            raise OverflowError("Python integer out of bounds for int32")
        decode_row(inputs, row, request)

    monkeypatch.setattr(engine, "_decode_row", poisoned)
    bad = {"model": NAME, "prompt": "poison", "max_tokens": 8, "seed": 666, "temperature": 0}
    good = {"model": NAME, "prompt": "Baseline", "max_tokens": 8, "temperature": 0}
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda body: httpx.post(f"{served.url}/v1/completions", json=body, timeout=60),
                                  [bad, good, good, bad]))
    for response in (responses[0], responses[3]):
        error = response.json()["error"]
        assert response.status_code == 500 and error["code"] == "error", error
        assert "out of bounds for int32" in error["message"] and "OverflowError" not in error["message"]
    assert [r.json()["choices"][0]["text"] for r in responses[1:3]] == [expected] * 2
    assert httpx.get(f"{served.url}/health").status_code == 200
    wait_idle(served)


def test_a_repeated_prompt_prefix_is_served_from_the_prefix_cache(served):
    system = "You are a terse assistant. Answer in one word. "
    first = served.client.completions.create(model=NAME, prompt=system + "Sky?", max_tokens=2, temperature=0)
    second = served.client.completions.create(model=NAME, prompt=system + "Sea?", max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    page_size = served.manager.engine.config.page_size
    ids = [served.tokenizer.encode(system + question) for question in ("Sky?", "Sea?")]
    common = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert cached == common // page_size * page_size > 0
    metrics = served.metrics()
    assert metrics["moe_jax_prompt_tokens_cached_total"] >= cached and metrics["moe_jax_pages_cached"] >= 1
    assert 0 < metrics["moe_jax_prefix_cache_hit_rate"] == pytest.approx(
        metrics["moe_jax_prompt_tokens_cached_total"] / metrics["moe_jax_prompt_tokens_total"])


# ---- sampling controls: log probabilities, n, echo, logit_bias, penalties, min_tokens, stop_token_ids -----------
def raw_logprobs(served, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """[len(tokens), V]: log_softmax of the served model's logits before each of `tokens`."""
    sequence = np.asarray([prompt + tokens[:-1]] * 2)   # a row per data-parallel group of the served layout
    logits = np.asarray(served.model.apply(served.model.params, sequence).logits[0], np.float64)[len(prompt) - 1:]
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_logprobs_equal_log_softmax_of_the_models_logits_plain_and_streamed(served):
    messages = [{"role": "user", "content": "Logs"}]
    ids = served.tokenizer.apply_chat_template(messages)
    tokens = served.model.generate(np.array([ids]), max_new_tokens=6)[0, len(ids):].tolist()
    reference = raw_logprobs(served, ids, tokens)
    text = [served.tokenizer.decode([token]) for token in tokens]
    chat = served.client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=5)
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == text
    np.testing.assert_allclose([entry.logprob for entry in content], reference[np.arange(6), tokens], atol=1e-5)
    for entry, row in zip(content, reference):
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 5
        np.testing.assert_allclose([top.logprob for top in entry.top_logprobs], np.sort(row)[::-1][:5], atol=1e-5)
    streamed = [entry for chunk in served.client.chat.completions.create(
        model=NAME, messages=messages, max_completion_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
        stream=True) if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [entry.token for entry in streamed] == text and all(len(entry.top_logprobs) == 2 for entry in streamed)
    np.testing.assert_allclose([entry.logprob for entry in streamed], reference[np.arange(6), tokens], atol=1e-5)
    # Completions: logprobs = the top count; token ids as the prompt.
    completion = served.client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0, logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == text and logprobs.text_offset == [sum(map(len, text[:i])) for i in range(6)]
    np.testing.assert_allclose(logprobs.token_logprobs, reference[np.arange(6), tokens], atol=1e-5)
    assert [len(top) for top in logprobs.top_logprobs] == [len({served.tokenizer.decode([int(i)]) for i in
                                                                np.argsort(-row)[:3]}) for row in reference]
    chunks = list(served.client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0, logprobs=0,
                                                   stream=True))
    streamed = [token for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for token in chunk.choices[0].logprobs.token_logprobs]
    np.testing.assert_allclose(streamed, reference[np.arange(6), tokens], atol=1e-5)
    assert served.client.completions.create(model=NAME, prompt=ids, max_tokens=2).choices[0].logprobs is None


def test_n_choices_each_sample_with_their_own_seed_plain_and_streamed(served):
    kwargs = dict(model=NAME, prompt="many", max_tokens=6, temperature=1.0)
    response = served.client.completions.create(**kwargs, n=4, seed=10)
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    texts = [choice.text for choice in response.choices]
    assert texts == [served.client.completions.create(**kwargs, seed=10 + i).choices[0].text for i in range(4)]
    assert len(set(texts)) > 1 and response.usage.completion_tokens == 24
    chunks = list(served.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                                        max_tokens=5, n=3, seed=4, stream=True,
                                                        stream_options={"include_usage": True}))
    streamed = {i: "".join(chunk.choices[0].delta.content or "" for chunk in chunks
                           if chunk.choices and chunk.choices[0].index == i) for i in range(3)}
    plain = served.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                                  max_tokens=5, n=3, seed=4)
    assert streamed == {choice.index: choice.message.content for choice in plain.choices}
    assert chunks[-1].usage.completion_tokens == 15
    assert sum(chunk.choices[0].finish_reason is not None for chunk in chunks if chunk.choices) == 3


def test_echo_logit_bias_penalties_min_tokens_and_stop_token_ids(served):
    prompt = "Echo"
    ids = served.tokenizer.encode(prompt)
    greedy = served.model.generate(np.array([ids]), max_new_tokens=8)[0, len(ids):].tolist()
    expected = served.tokenizer.decode(greedy)

    def complete(**kwargs):
        return served.client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, **kwargs)

    assert complete(echo=True).choices[0].text == prompt + expected
    assert "".join(chunk.choices[0].text for chunk in complete(echo=True, stream=True)) == prompt + expected
    assert complete(logit_bias={"65": 100}).choices[0].text == served.tokenizer.decode([65] * 8)
    assert complete(logit_bias={str(token): -100 for token in set(greedy)}).choices[0].text != expected
    unbiased = complete(logprobs=0, logit_bias={str(token): -100 for token in set(greedy)}).choices[0].logprobs
    assert not set(unbiased.tokens) & ({served.tokenizer.decode([token]) for token in greedy} - {"\ufffd"})
    assert complete(frequency_penalty=2.0, presence_penalty=2.0).choices[0].text != expected
    assert complete(extra_body={"repetition_penalty": 3.0}).choices[0].text != expected
    stop_at = greedy[3]
    stopped = complete(extra_body={"stop_token_ids": [stop_at]}).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == served.tokenizer.decode(greedy[:greedy.index(stop_at) + 1])
    held = complete(extra_body={"stop_token_ids": [greedy[0]], "min_tokens": 4}).choices[0]
    assert held.finish_reason in ("stop", "length") and len(served.tokenizer.encode(held.text)) >= 4


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "echo": True, "logprobs": 1}, "echo"), ({"prompt": "a", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "a", "logprobs": True}, "logprobs"), ({"prompt": "a", "n": 17}, "n"),
    ({"prompt": "a", "logit_bias": {"256": 1}}, "logit_bias"),
    ({"prompt": "a", "stop_token_ids": [300]}, "stop_token_ids"),
    ({"prompt": "a", "presence_penalty": True}, "presence_penalty"), ({"prompt": "a", "min_tokens": 17}, "min_tokens"),
    ({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_sampling_controls_are_400s_naming_the_field(served, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(f"{served.url}{path}", json={"model": NAME, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def decoded_routing(entry: dict) -> np.ndarray:
    assert entry["dtype"] == "int16"
    return np.frombuffer(base64.b64decode(entry["data"]), "<i2").reshape(entry["shape"])


def test_return_routing_gives_each_choice_its_tokens_expert_ids_plain_and_streamed(served):
    ids = served.tokenizer.encode("Route")
    body = dict(model=NAME, prompt=ids, max_tokens=5, temperature=0, n=2, return_routing=True)
    response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()
    tokens = ids + served.model.generate(np.array([ids]), max_new_tokens=5)[0, len(ids):].tolist()
    rows = np.tile(np.asarray(tokens), (served.model.data_parallel_size, 1))
    expected = np.asarray(served.model.apply(served.model.params, rows, return_routing=True).routing[0])
    for choice in response["choices"]:
        routing = decoded_routing(choice["routing"])
        assert routing.shape == expected.shape and (routing[:, -1] == -1).all()
        np.testing.assert_array_equal(routing[:, :-1], expected[:, :-1])
    messages = [{"role": "user", "content": "Route"}]
    chat = dict(model=NAME, messages=messages, max_tokens=4, temperature=0, return_routing=True)
    plain = httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]["routing"]
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as sse:
        events = [json.loads(line[6:]) for line in sse.iter_lines() if line.startswith("data: {")]
    last = [event["choices"][0] for event in events if event["choices"] and event["choices"][0]["finish_reason"]]
    assert last[-1]["routing"] == plain
    assert "routing" not in httpx.post(f"{served.url}/v1/completions", json={**body, "return_routing": False},
                                       timeout=60).json()["choices"][0]
    refused = httpx.post(f"{served.url}/v1/completions", json={**body, "return_routing": "yes"}, timeout=60)
    assert refused.status_code == 400 and "return_routing" in refused.text
