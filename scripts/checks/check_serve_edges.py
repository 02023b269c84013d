"""`moe-jax serve` against a hostile client: each attack runs while a stream is generating, and must be refused
(4xx, or the connection closed) without stalling that stream or keeping memory.

    python scripts/checks/check_serve_edges.py [--workdir DIR] [--cold] [--serve-flags "--max-slots 8"]

Starts the real command in a subprocess on a tiny random Qwen3-MoE (tests/serving/live.py's, a byte tokenizer)
with an API key and one allowed origin; with --cold, first once with an empty compilation cache, to time a cold
start against the warm one. A subprocess keeps streams running back to back; for each attack the script prints the
status it got, the seconds until it was refused, the longest gap between two tokens of the concurrent stream
while it ran, and the server's resident memory before and after. Last, two SIGINTs while streams run: each
stream must end with an error event and `data: [DONE]`, and the command must exit 0 without a traceback. Exits 1
when an attack is not refused, is refused later than LIMIT_S, a gap exceeds MAX_GAP_S, or memory does not come
back within 20% of the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

KEY = "sk-edge-check"
ORIGIN = "https://a.com"
LIMIT_S = 1.0        # every refusal within this
MAX_GAP_S = 0.3      # the concurrent stream's longest gap between tokens
RSS_SLACK = 0.2      # memory after the attacks within this fraction of the baseline
FLAGS = ("--max-slots", "4", "--page-size", "16", "--max-model-len", "256", "--prefill-chunk", "32",
         "--log-level", "warning", "--api-key", KEY, "--allowed-origins", ORIGIN, "--drain-timeout", "30")


# ---- the server ---------------------------------------------------------------------------------------------
def start(checkpoint: Path, cache: Path, *flags: str, env: dict | None = None):
    """`moe-jax serve` -> (process, port, seconds until ready, stderr lines so far)."""
    command = [sys.executable, "-m", "moe_jax.cli", "serve", "--model", str(checkpoint), "--port", "0",
               "--compile-cache", str(cache), *flags]
    environ = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT)) | (env or {})
    environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    started = time.perf_counter()
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=environ)
    lines = []
    for line in process.stderr:
        lines.append(line)
        if line.startswith("serving "):
            port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", line).group(1))
            return process, port, time.perf_counter() - started, lines
    raise SystemExit("the server did not start:\n" + "".join(lines))


def rss_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024


def startup_refusal(checkpoint: Path, *flags: str, env: dict | None = None) -> tuple[str, float, bool]:
    """A start the command must refuse (env: None unsets) -> ("exit N: its error line", seconds, refused with
    exit 2 and one error line)."""
    command = [sys.executable, "-m", "moe_jax.cli", "serve", "--model", str(checkpoint), "--port", "0", *flags]
    environ = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT)) | (env or {})
    environ = {name: value for name, value in environ.items() if value is not None}
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=environ, timeout=120)
    seconds = time.perf_counter() - started
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    ok = result.returncode == 2 and len(errors) == 1
    return f"exit {result.returncode}: {errors[0][:60] if errors else result.stderr[-200:]!r}", seconds, ok


# ---- clients --------------------------------------------------------------------------------------------------
def head(method: str, path: str, headers: dict | list, body_length: int | None = None) -> bytes:
    pairs = list(headers.items()) if isinstance(headers, dict) else list(headers)
    if body_length is not None:
        pairs.append(("Content-Length", str(body_length)))
    lines = [f"{method} {path} HTTP/1.1"] + [f"{name}: {value}" for name, value in pairs]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def raw(port: int, data_parts, timeout: float = 30.0) -> tuple[str, float]:
    """Sends the parts (bytes, or an iterable of chunks) on one connection until the server answers or closes it
    -> (its status, or "closed", seconds until then)."""
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
        answered = threading.Event()
        reply = bytearray()

        def read():
            try:
                while True:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    reply.extend(chunk)
                    if b"\r\n\r\n" in reply:
                        break
            except OSError:
                pass
            answered.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            for part in data_parts:
                if answered.is_set():
                    break
                sock.sendall(part)
        except OSError:   # the server refused and closed while we were still sending
            pass
        answered.wait(timeout)
        seconds = time.perf_counter() - started
    status = reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/1.1 ") else "closed"
    return status, seconds


def post(port: int, path: str, body: bytes, *, headers: dict | None = None, chunked: bool = False):
    base = {"Host": "127.0.0.1", "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    base |= headers or {}
    if not chunked:
        return raw(port, chunks(head("POST", path, base, len(body)), body))
    base["Transfer-Encoding"] = "chunked"
    pieces = (b"%x\r\n%s\r\n" % (len(body[i:i + 65536]), body[i:i + 65536]) for i in range(0, len(body), 65536))
    return raw(port, [head("POST", path, base)] + list(pieces) + [b"0\r\n\r\n"])


def chunks(first: bytes, body: bytes, size: int = 1 << 16):
    yield first
    for start in range(0, len(body), size):
        yield body[start:start + size]


# A separate process streams (its clock is the system's monotonic one): the attacks' own work in this process
# cannot delay what it records.
STREAMER = """
import sys, time, httpx
port, key = sys.argv[1:]
body = {"prompt": "Once upon a time", "max_tokens": 200, "stream": True, "temperature": 0}
with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {key}"}) as client:
    while True:
        with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    print(time.monotonic(), flush=True)
"""


class Streamer:
    """Streams back to back in a subprocess; `times` holds the arrival time of every token chunk."""

    def __init__(self, port: int):
        self.process = subprocess.Popen([sys.executable, "-c", STREAMER, str(port), KEY], stdout=subprocess.PIPE,
                                        text=True)
        self.times: list[float] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.times.append(float(line))

    def max_gap(self, start: float, end: float) -> float:
        """The longest wait between two chunks (of one stream, or the last of one and the first of the next) that
        overlaps [start, end]."""
        times = list(self.times)
        return max((b - a for a, b in zip(times, times[1:]) if b >= start and a <= end), default=float("nan"))

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


# ---- the attacks ----------------------------------------------------------------------------------------------
def attacks(port: int, checkpoint: Path):
    json_headers = {"Host": "127.0.0.1", "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    def chat(messages, **fields) -> bytes:
        return json.dumps({"messages": messages, "max_tokens": 4} | fields).encode()

    def parallel(count: int, function):
        with ThreadPoolExecutor(count) as pool:
            results = list(pool.map(lambda _: function(), range(count)))
        statuses = sorted({status for status, _ in results})
        return "/".join(statuses), max(seconds for _, seconds in results)

    # Each payload is built before its attack is timed (the generator runs up to the next yield first).
    body = chat([{"role": "u" * (2 << 20), "content": "hi"}])
    yield "a 2 MB chat role", "4", lambda: post(port, "/v1/chat/completions", body)
    body = chat([{"role": "u" * 600_000, "content": "hi"}])
    yield "a 600 KB chat role", "400", lambda: post(port, "/v1/chat/completions", body)
    body = chat([{"role": "user", "content": "hi", "name": "n" * 600_000}])
    yield "a 600 KB message name", "400", lambda: post(port, "/v1/chat/completions", body)
    body = chat([{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"description": "d" * 600_000}}}])
    yield "600 KB of tool schemas", "400", lambda: post(port, "/v1/chat/completions", body)
    body = chat([{}] * 100_000)
    yield "100k empty messages", "400", lambda: post(port, "/v1/chat/completions", body)
    tokens = b'{"prompt": [' + b"1," * ((8 << 20) // 2 - 64) + b'1], "max_tokens": 1}'   # just under 8 MiB
    yield "16 x 8 MB token-id prompts", "4", lambda: parallel(16, lambda: post(port, "/v1/completions", tokens))
    yield "16 x 8 MB token-id prompts, chunked", "4", lambda: parallel(
        16, lambda: post(port, "/v1/completions", tokens, chunked=True))
    text = b'{"prompt": "' + b"x" * ((8 << 20) - 64) + b'", "max_tokens": 1}'
    yield "16 x 8 MB text prompts", "4", lambda: parallel(16, lambda: post(port, "/v1/completions", text))
    small = b'{"prompt": [' + b"1," * 300_000 + b'1], "max_tokens": 1}'
    yield "16 x 600 KB token-id prompts", "400", lambda: parallel(16, lambda: post(port, "/v1/completions", small))
    big = b"a" * (32 << 20)
    yield "32 MB of headers", "431", lambda: raw(port, chunks(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nx-big: ",
                                                               big))
    many = head("GET", "/v1/models", [("Host", "127.0.0.1")] + [(f"x-h{i}", "v") for i in range(2_000_000)])
    yield "2 million headers", "431", lambda: raw(port, chunks(b"", many))
    yield "101 headers", "431", lambda: raw(port, [head("GET", "/v1/models", [("Host", "127.0.0.1")] + [
        ("Authorization", f"Bearer {KEY}")] + [(f"x-h{i}", "v") for i in range(99)])])
    yield "keep-alive slowloris x3 (10 s header timeout)", "closed", lambda: parallel(3, lambda: slowloris(port))
    yield "duplicate Host", "400", lambda: raw(port, [head("GET", "/v1/models", [
        ("Host", "127.0.0.1"), ("Host", "evil.example"), ("Authorization", f"Bearer {KEY}")])])
    yield "duplicate Authorization", "400", lambda: raw(port, [head("GET", "/v1/models", [
        ("Host", "127.0.0.1"), ("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {KEY}")])])
    yield "a 60 KB model name (404 echoes 64 characters)", "404", lambda: echoed(port, json_headers)
    yield "max_tokens: true", "400", lambda: post(port, "/v1/completions", b'{"prompt": "a", "max_tokens": true}')
    yield "temperature: false", "400", lambda: post(port, "/v1/completions", b'{"prompt": "a", "temperature": false}')
    yield "Origin https://a.com.evil.net", "403", lambda: post(port, "/v1/completions", b'{"prompt": "a"}',
                                                               headers={"Origin": "https://a.com.evil.net"})
    yield "startup: --allowed-origins '*' without a key", "exit 2", lambda: startup_refusal(
        checkpoint, "--allowed-origins", "*", env={"MOE_JAX_API_KEY": None})
    yield "startup: --api-key ''", "exit 2", lambda: startup_refusal(checkpoint, "--api-key", "")
    yield "startup: MOE_JAX_API_KEY=''", "exit 2", lambda: startup_refusal(checkpoint,
                                                                           env={"MOE_JAX_API_KEY": ""})


def echoed(port: int, headers: dict) -> tuple[str, float]:
    import httpx

    started = time.perf_counter()
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers=headers, timeout=30,
                          content=json.dumps({"model": "m" * 60_000, "prompt": "a"}).encode())
    message = response.json()["error"]["message"]
    return f"{response.status_code} ({len(message)} chars)", time.perf_counter() - started


def slowloris(port: int) -> tuple[str, float]:
    """A keep-alive connection: one whole request, then the next one's headers a byte every 0.5 s -> ("closed",
    seconds from the first response until the server closed it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head("GET", "/health", {"Host": "127.0.0.1"}))
        sock.recv(65536)
        started = time.perf_counter()
        try:
            for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"x" * 1000:
                sock.sendall(bytes([byte]))
                time.sleep(0.5)
                if time.perf_counter() - started > 60:
                    return "open after 60 s", time.perf_counter() - started
        except OSError:
            pass
        return "closed", time.perf_counter() - started


def check_double_sigint(process, port: int, streams: int = 4) -> tuple[bool, str]:
    """Streams running (each started, none near its end), two SIGINTs: every stream ends with an error event and
    [DONE], the command exits 0, without a traceback."""
    import httpx

    first_tokens = threading.Barrier(streams + 1)

    def stream() -> list[str]:
        events = []
        body = {"prompt": "Twice", "max_tokens": 240, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        first_tokens.wait(30)
        return events

    with ThreadPoolExecutor(streams) as pool:
        running = [pool.submit(stream) for _ in range(streams)]
        first_tokens.wait(30)
        process.send_signal(signal.SIGINT)
        time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        results = [future.result(60) for future in running]
    code = process.wait(60)
    stderr = process.stderr.read()
    ended = all(events and events[-1] == "[DONE]" and any('"error"' in e for e in events[:-1]) for events in results)
    ok = ended and code == 0 and "Traceback" not in stderr
    return ok, (f"{len(results)} streams ended with an error event and [DONE]: {ended}; exit {code}; traceback: "
                f"{'Traceback' in stderr}; last lines: {stderr.strip().splitlines()[-2:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--cold", action="store_true", help="first start once with an empty compilation cache")
    parser.add_argument("--serve-flags", default="", help="more flags for the server (after the script's own)")
    args = parser.parse_args()
    flags = FLAGS + tuple(shlex.split(args.serve_flags))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="serve_edges_"))
    checkpoint, cache = workdir / "tiny", workdir / "compile_cache"
    if not checkpoint.exists():
        from tests.serving.live import write_checkpoint

        write_checkpoint(checkpoint)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if args.cold:
        shutil.rmtree(cache, ignore_errors=True)
        process, _, seconds, _ = start(checkpoint, cache, *flags)
        print(f"cold start (empty compilation cache): ready after {seconds:.1f} s")
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    process, port, seconds, lines = start(checkpoint, cache, *flags)
    print(f"{'warm' if args.cold else 'this'} start: ready after {seconds:.1f} s ({lines[-1].strip()[-40:]}")
    streamer = Streamer(port)
    time.sleep(5.0)
    quiet = time.monotonic()
    time.sleep(3.0)
    baseline = rss_mb(process.pid)
    failures = 0
    print(f"no attack: the stream's longest gap {streamer.max_gap(quiet, time.monotonic()):.3f} s; RSS "
          f"{baseline:.0f} MB")
    print(f"{'attack':50} {'status':>22} {'refused':>9} {'max gap':>8} {'RSS before':>11} {'after':>8}")
    for name, expected, attack in attacks(port, checkpoint):
        before = rss_mb(process.pid)
        started = time.monotonic()
        status, seconds, *verdict = attack()
        ended = time.monotonic()
        time.sleep(0.5)
        gap = streamer.max_gap(started, ended + 0.2)
        after = rss_mb(process.pid)
        timed = "slowloris" in name or "startup" in name   # a timeout by design; a separate process
        ok = (verdict[0] if verdict else status.startswith(expected)) and (timed or seconds <= LIMIT_S) and (
            gap <= MAX_GAP_S or "startup" in name)
        failures += not ok
        print(f"{name:50} {status[:22]:>22} {seconds:8.2f}s {gap:7.3f}s {before:9.0f}MB {after:6.0f}MB"
              f"{'' if ok else '  <- FAILED'}")
    time.sleep(2.0)
    final = rss_mb(process.pid)
    memory_ok = final <= baseline * (1 + RSS_SLACK)
    failures += not memory_ok
    print(f"RSS: baseline {baseline:.0f} MB, after the attacks {final:.0f} MB ({final / baseline - 1:+.0%})"
          f"{'' if memory_ok else '  <- FAILED'}")
    streamer.stop()
    ok, report = check_double_sigint(process, port)
    failures += not ok
    print(f"two SIGINTs: {report}{'' if ok else '  <- FAILED'}")
    print("all refused in time, streams smooth" if not failures else f"{failures} FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
