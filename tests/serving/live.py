"""A live server for the serving tests: a tiny random checkpoint with a byte-level tokenizer and a chat template,
served by uvicorn in a thread on 127.0.0.1, and a client's view of it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import numpy as np
import openai
import uvicorn

from moe_jax import AutoModelForCausalLM
from moe_jax.serving import build_app
from moe_jax.serving.server import draining_server_class, header_timeout_protocol
from moe_jax.tokenization import write_byte_tokenizer

CONFIG = dict(model_type="qwen3_moe", vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
              num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True, max_position_embeddings=256,
              tie_word_embeddings=False)
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
NAME = "tiny-moe"
MAX_MODEL_LEN = 256
SERVER_FLAGS = dict(max_slots=4, page_size=8, max_model_len=MAX_MODEL_LEN, prefill_chunk=16)


def write_checkpoint(directory):
    """A random tiny Qwen3-MoE (vocabulary 256: the byte tokenizer's) with a chat template."""
    model = AutoModelForCausalLM.from_config(CONFIG, devices=jax.devices()[:1])
    model.init_params(0)
    model.params = {name: value * (8.0 if name.endswith("mlp.gate.weight") else 1.0)
                    for name, value in model.params.items()}
    model.save_pretrained(directory, progress=False)
    write_byte_tokenizer(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHAT_TEMPLATE}))
    return directory


def free_socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class Served:
    def __init__(self, model, manager, tokenizer, port):
        self.model, self.manager, self.tokenizer, self.port = model, manager, tokenizer, port
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def greedy(self, prompt_ids: list[int], new_tokens: int) -> str:
        """What `model.generate` continues `prompt_ids` with, as text."""
        out = self.model.generate(np.array([prompt_ids]), max_new_tokens=new_tokens)
        return self.tokenizer.decode(out[0, len(prompt_ids):].tolist())

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        return {match[1]: float(match[2]) for match in re.finditer(r"^(moe_jax_\w+) (\S+)$", text, re.M)}



@contextlib.contextmanager
def serving(model, manager, tokenizer, *, drain_timeout: float = 30.0, header_timeout: float = 10.0,
            **app_options):
    """`build_app` over `manager` served by a `DrainingServer` (as `moe-jax serve` runs it) in a thread ->
    `Served`; shut down on exit."""
    app = build_app(manager, tokenizer, model_name=NAME, max_model_len=manager.engine.config.max_model_len,
                    drain_timeout=drain_timeout, **app_options)
    sock = free_socket()
    config = uvicorn.Config(app, log_level="warning", lifespan="on", http=header_timeout_protocol(header_timeout))
    server = draining_server_class()(config, manager, drain_timeout=drain_timeout)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    served = Served(model, manager, tokenizer, sock.getsockname()[1])
    served.server, served.thread = server, thread
    try:
        yield served
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


@contextlib.contextmanager
def serve_command(checkpoint, *flags: str):
    """`moe-jax serve --model checkpoint --port 0 FLAGS` in a subprocess -> (process, its stderr lines up to and
    including the "serving ..." line); killed if still running on exit, or after 180 s (reading its lines must
    not hang the suite)."""
    command = [sys.executable, "-m", "moe_jax.cli", "serve", "--model", str(checkpoint), "--port", "0", *flags]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=os.environ | {"JAX_PLATFORMS": "cpu"})
    watchdog = threading.Timer(180, process.kill)
    watchdog.start()
    try:
        lines = []
        for line in process.stderr:
            lines.append(line)
            if line.startswith("serving "):
                break
        yield process, lines
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()
