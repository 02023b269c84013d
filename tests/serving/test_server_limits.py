"""The server under more traffic than it holds (`moe_jax.serving.server` and the manager's bounds): a bounded queue
answers 429 with Retry-After, a queue timeout 503, a drain ends every stream with `[DONE]` or an error event, and an
engine that dies stops the server with exit code 1. One device, two slots, steps slowed to 20 ms so that requests
overlap on any machine."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
pytest.importorskip("jinja2")

import jax  # noqa: E402

from moe_jax import AutoModelForCausalLM  # noqa: E402
from moe_jax.tokenization import load_checkpoint_tokenizer  # noqa: E402

from .live import NAME, serve_command, serving, write_checkpoint  # noqa: E402

FLAGS = dict(max_slots=2, page_size=8, max_model_len=64, prefill_chunk=16)
STEP_S = 0.02


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    directory = write_checkpoint(tmp_path_factory.mktemp("limits") / "tiny")
    model = AutoModelForCausalLM.from_pretrained(directory, devices=jax.devices()[:1], progress=False)
    return model, load_checkpoint_tokenizer(directory, instead="-")


def slow_manager(model, tokenizer, monkeypatch, **options):
    """A manager whose steps take at least STEP_S (its programs compiled first)."""
    manager = model.init_continuous_batching(decode=tokenizer.decode, **FLAGS, **options)
    manager.engine.compile_all()
    step = manager.engine.step
    monkeypatch.setattr(manager.engine, "step", lambda: (time.sleep(STEP_S), step())[1])
    return manager


def complete(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": NAME, "temperature": 0} | body, timeout=60)


def stream_events(url: str, body: dict) -> list:
    """A streaming request's events: parsed JSON chunks and the final "[DONE]"."""
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": NAME, "temperature": 0, "stream": True} | body,
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return events


@pytest.mark.heavy   # the suite keeps the queue timeout's 503 below
def test_beyond_the_queue_bound_requests_get_429_with_retry_after(model_and_tokenizer, monkeypatch):
    """40 concurrent requests on 2 slots with 8 queued at most: the rest are refused at once, every accepted one
    completes with generate's greedy text."""
    model, tokenizer = model_and_tokenizer
    manager = slow_manager(model, tokenizer, monkeypatch, max_queued=8)
    prompt = "Queue"
    expected = tokenizer.decode(model.generate([tokenizer.encode(prompt)], max_new_tokens=6)[0, len(prompt):].tolist())
    with serving(model, manager, tokenizer) as served:
        with ThreadPoolExecutor(40) as pool:
            responses = list(pool.map(lambda _: complete(served.url, {"prompt": prompt, "max_tokens": 6}), range(40)))
        refused = [r for r in responses if r.status_code == 429]
        accepted = [r for r in responses if r.status_code == 200]
        # At least the 8 the queue holds: the 2 slots take theirs at the engine's next step, which under load may
        # come after the whole burst.
        assert len(refused) + len(accepted) == 40 and refused and len(accepted) >= 8
        assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full" for r in refused)
        assert {r.json()["choices"][0]["text"] for r in accepted} == {expected}


# heavy: a second admission bound; the queue's 429 stays in the suite
@pytest.mark.heavy
def test_a_request_waiting_past_the_queue_timeout_gets_503(model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    manager = slow_manager(model, tokenizer, monkeypatch, queue_timeout=0.2)
    with serving(model, manager, tokenizer) as served:
        with ThreadPoolExecutor(3) as pool:
            long = [pool.submit(complete, served.url, {"prompt": "long", "max_tokens": 40}) for _ in range(2)]
            time.sleep(0.2)   # both slots taken
            waited = complete(served.url, {"prompt": "late", "max_tokens": 2})
            assert waited.status_code == 503 and waited.json()["error"]["code"] == "queue_timeout"
            assert "waited more than 0.2 s" in waited.json()["error"]["message"]
            assert all(future.result().status_code == 200 for future in long)


# heavy: the SIGTERM drain test runs a drain in the suite
@pytest.mark.heavy
def test_a_drain_ends_every_stream_with_done_or_an_error_event(model_and_tokenizer, monkeypatch):
    """What SIGTERM does (uvicorn sets should_exit): the queued requests are refused at once, the running ones
    have the drain time, then end with an error event; none is cut without one."""
    model, tokenizer = model_and_tokenizer
    manager = slow_manager(model, tokenizer, monkeypatch)
    with serving(model, manager, tokenizer, drain_timeout=0.5) as served:
        with ThreadPoolExecutor(6) as pool:
            streams = [pool.submit(stream_events, served.url, {"prompt": f"s{i}", "max_tokens": 60}) for i in range(5)]
            plain = pool.submit(complete, served.url, {"prompt": "queued", "max_tokens": 60})
            deadline = time.monotonic() + 30
            while manager.engine.slots_in_use < 2 or manager.waiting_requests() < 4:
                assert time.monotonic() < deadline, manager.metrics()
                time.sleep(0.01)
            started = time.monotonic()
            served.server.should_exit = True
            results = [future.result(30) for future in streams]
            refused = plain.result(30)
        served.thread.join(30)
        assert not served.thread.is_alive() and time.monotonic() - started < 5
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutdown"
    assert all(events[-1] == "[DONE]" for events in results)
    errors = [next(e["error"] for e in events if isinstance(e, dict) and "error" in e) for events in results
              if any(isinstance(e, dict) and "error" in e for e in events)]
    assert len(errors) == 5   # 60 tokens at 20 ms a step outlast a 0.5 s drain; 3 of them never started
    # The 3 queued never started; under load a slotted one may not have sent its first token before the drain.
    assert sum("did not start" in error["message"] for error in errors) >= 3
    assert served.server.exit_code() == 0


def test_an_engine_failure_stops_the_server_with_exit_code_1(model_and_tokenizer, monkeypatch):
    """The request in flight gets a 500 without the exception's class; /health says 503; the server shuts itself
    down so that a supervisor restarts the process."""
    model, tokenizer = model_and_tokenizer
    manager = model.init_continuous_batching(decode=tokenizer.decode, **FLAGS)

    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(manager.engine, "step", broken_step)
    with serving(model, manager, tokenizer) as served:
        response = complete(served.url, {"prompt": "boom", "max_tokens": 4})
        error = response.json()["error"]
        assert response.status_code == 500 and error["code"] == "engine_error"
        assert "RuntimeError" not in error["message"] and "device lost" not in error["message"]
        served.thread.join(10)
        assert not served.thread.is_alive()
        assert served.server.exit_code() == 1


def test_a_connection_that_trickles_its_headers_is_closed(model_and_tokenizer):
    """A slow-headers client (slowloris) holds a connection only as long as the header timeout, on a keep-alive
    connection's later requests too; a request whose head passes its byte bound gets 431 before more is read."""
    import socket

    model, tokenizer = model_and_tokenizer
    manager = model.init_continuous_batching(decode=tokenizer.decode, **FLAGS)
    health = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with serving(model, manager, tokenizer, header_timeout=0.3) as served:
        def connect():
            return socket.create_connection(("127.0.0.1", served.port), timeout=5)

        with connect() as client:
            client.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")   # never ends its headers
            started = time.monotonic()
            assert client.recv(1024) == b""   # closed by the server
            assert 0.2 < time.monotonic() - started < 3
        with connect() as client:   # keep-alive: two whole requests are answered, a trickled third is closed
            for request in range(2):
                time.sleep(0.2 * request)   # the time since the previous response counts, not the connection's
                client.sendall(health)
                assert client.recv(4096).startswith(b"HTTP/1.1 200")
            started = time.monotonic()
            client.sendall(b"GET /health HTTP/1.1\r\n")
            time.sleep(0.1)
            client.sendall(b"Host: 127.0.0.1\r\n")
            assert client.recv(1024) == b"" and 0.2 < time.monotonic() - started < 3
        for first in (b"", health):   # 64 KiB of headers, on a new connection or a keep-alive one's next request
            with connect() as client:
                if first:
                    client.sendall(first)
                    client.recv(4096)
                try:
                    client.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nx-big: " + b"a" * (64 << 10))
                except OSError:   # closed while sending
                    pass
                reply = client.recv(4096)
                assert reply.startswith(b"HTTP/1.1 431") and b"request_header_fields_too_large" in reply, reply
        with connect() as client:   # a body arriving with its headers is not counted as headers
            body = json.dumps({"model": "other", "prompt": "x" * (100 << 10)}).encode()
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert client.recv(4096).startswith(b"HTTP/1.1 400")
        assert httpx.get(f"{served.url}/health").status_code == 200   # whole headers are answered


def test_the_serve_command_drains_on_sigterm_and_ends_streams_at_a_second_signal(tmp_path):
    """The real command: it reports each program as it compiles, then the ready line, and answers. SIGTERM while
    two streams run and two wait refuses the waiting ones; a Ctrl-C then ends the running ones at once instead of
    after the 30 s drain. Each stream ends with an error event and `[DONE]`, and the command exits 0 without a
    traceback."""
    flags = ("--max-slots", "2", "--page-size", "16", "--max-model-len", "256", "--prefill-chunk", "16",
             "--log-level", "warning", "--drain-timeout", "30", "--decode-rows", "2")
    with serve_command(write_checkpoint(tmp_path / "tiny"), *flags) as (process, lines):
        started = lines[-1] if lines else ""
        assert started.startswith("serving tiny at http://127.0.0.1:"), "".join(lines)
        assert "tp=1 fsdp=1 ep=1" in started and "2 slots" in started and "pages of 16 tokens" in started
        # A line for each program as it compiles, then the ready line with the URL.
        compiling = [line for line in lines if line.startswith("compiling program ")]
        count = len(compiling)
        assert count > 1 and f"{count} programs compiled" in started
        assert [line.split(":")[0] for line in compiling] == [f"compiling program {i} of {count}"
                                                              for i in range(1, count + 1)]
        assert re.fullmatch(rf"compiling program 1 of {count}: mixed \[\d+ x 16\] width \d+ \.\.\. \d+\.\d s\n",
                            compiling[0])
        assert any("decode [2 x 1] width" in line for line in compiling)
        url = re.search(r"(http://\S+)/v1", started).group(1)
        answer = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4,
                                                            "temperature": 0}, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 4 and answer["choices"][0]["finish_reason"] == "length"
        first_tokens = threading.Semaphore(0)

        def stream(i: int) -> list:
            events = []
            body = {"model": "tiny", "prompt": f"p{i}", "max_tokens": 250, "temperature": 0, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                        if len(events) == 1:
                            first_tokens.release()
            return events

        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(stream, i) for i in range(4)]
            for _ in range(2):   # the two in slots have started (the queued two send nothing before the signal)
                assert first_tokens.acquire(timeout=60)
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            time.sleep(0.1)
            process.send_signal(signal.SIGINT)
            results = [future.result(60) for future in streams]
        assert process.wait(60) == 0 and time.monotonic() - signalled < 15
        assert all(events[-1] == "[DONE]" and "error" in events[-2] for events in results)
        stderr = process.stderr.read()
        assert re.search(r"stopped: \d+ requests finished", stderr) and "Traceback" not in stderr
