"""An OpenAI-compatible HTTP server over continuous batching (`moe-jax serve`, or `build_app` in Python).

    manager = model.init_continuous_batching(max_slots=8, max_model_len=2048, decode=tokenizer.decode)
    app = build_app(manager, tokenizer, model_name="my-model", max_model_len=2048)
    uvicorn.run(app, host="127.0.0.1", port=8000)

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="my-model", prompt="Hello", max_tokens=32, stream=True)

What runs: one `ContinuousBatchingManager` (its engine on a background thread) shared by every HTTP request.
The engine's programs have shapes its config fixes, whatever the requests: mixed (or prefill) [data-parallel
groups x prefill_rows (+ max_slots), prefill_chunk] and decode [groups x rows, 1] for each of `decode_rows`
(each for the page-table widths the engine uses, where it has several; `engine.compiled_shapes`), so requests
join and leave the running batch without recompiling;
`moe-jax serve` compiles them all before it listens. Any layout of tp, fsdp, ep and dp_replicate, in one process
or several (process 0 serves HTTP and leads: `ServingEngine.lead` / `follow`); not pipeline stages.

Modules: `app` (routes, streaming, disconnects), `protocol` (request bodies and their bounds, OpenAI's error
shape), `guard` (Host, Origin, API key, content type, body size), `server` (uvicorn with a drain on SIGTERM and
an exit when the engine fails), `text` (ids -> streamed text, stop strings), `tool_calls` (each family's tool-call
syntax -> OpenAI's `tool_calls`, plain and streamed), `metrics` (Prometheus text). FastAPI, uvicorn and pydantic are the
optional `serve` extra (pip install "moe_jax[serve]"); nothing else in moe_jax imports this package.
"""

from .app import build_app
from .guard import GuardSettings

__all__ = ["GuardSettings", "build_app"]
