"""`moe-jax serve`: an OpenAI-compatible HTTP server over continuous batching (`moe_jax.serving`).

    moe-jax serve --model ckpt/ --port 8000 --max-slots 16 --max-model-len 4096 --tp 2 --ep 4 --fsdp 4
    moe-jax serve --model ckpt/ --adapter lora/ [--merge-adapter]     # a PEFT LoRA adapter, unmerged or merged
    moe-jax serve --model ckpt/ --lora-modules sql=a/ chat=b/         # several, a request's "model" picks one
    curl http://127.0.0.1:8000/v1/completions -H "Content-Type: application/json" -d '{"prompt": "Hi", "max_tokens": 32}'
    openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused").chat.completions.create(...)

The checkpoint is loaded on the layout the flags give (one device without them), and its engine compiles
two kinds of programs: mixed [data-parallel groups x --prefill-rows + --max-slots, --prefill-chunk] (and the
same with fewer prompt rows, powers of two, for steps whose prompts fill fewer; a step that prefills a prompt
chunk decodes every other running request in the same program, reading the weights once; --no-mixed-steps: a
separate prefill [groups x --prefill-rows, --prefill-chunk] instead) and decode [groups x rows, 1] for each of
--decode-rows (a decode step packs its requests into the fewest rows that hold them: default --max-slots per
group and its quarters down to 1), each for every page-table width the engine uses (`ServingEngine.page_widths`).
With --warmup (the default) all of them compile before the port accepts connections, so no client waits for a
compilation, a line on stderr for each (bench_serve's 16 slots: 24 programs, about a minute on a 2-core CPU;
--decode-rows 16 halves that); then the "serving ... at URL" line says it is ready. Compiled programs are kept in
JAX's persistent compilation cache (`moe_jax.compilation_cache`: --compile-cache DIR, else
$JAX_COMPILATION_CACHE_DIR, else ~/.cache/moe_jax/jax_compilation_cache; --no-compile-cache: none), so a later
start on the same checkpoint and flags reads them back instead of compiling them. Memory: --num-pages pages of
--page-size tokens of keys and values per layer (default: every slot at --max-model-len).

In production (docs/inference.md): --api-key (or MOE_JAX_API_KEY; empty: an error) requires `Authorization:
Bearer KEY` on every endpoint but /health (and /metrics with --metrics-public); browsers' cross-origin calls are
refused unless --allowed-origins lists the page's origin exactly ('*' only with a key); bound to a loopback
address, the server answers only to loopback Host names. Requests are bounded before any costly work: headers
(32 KiB, 100 of them, each due within 10 s, keep-alive requests included), bodies (--max-request-bytes: 413), and
what a body holds, counted as it is parsed (values, text, nesting: no more than the context can use). More than
--max-queued-requests waiting for a slot get 429 with Retry-After; a request waiting longer than --queue-timeout
gets 503. SIGTERM or Ctrl-C drains: no new connections or requests, the queued ones refused (503), the running
ones given --drain-timeout seconds, then ended with an error event (a second Ctrl-C ends them at once, the same
way); the command exits 0 after a clean drain and 1 if the engine failed (a supervisor restarts it).

Tool calls: chat requests' `tools` reach the chat template, and with tool_choice "auto" the model's calls are parsed
into `tool_calls` in the syntax --tool-call-parser names (default: the checkpoint's family's, where known).

Multi-process (`moe-jax launch --nproc N -- moe-jax serve ...`): process 0 listens and schedules, and sends
each step's inputs to the other processes, which run the same programs on their devices until it stops. There are
no pipeline flags (a paged cache does not run through pipeline stages). Needs the `serve` extra (fastapi, uvicorn,
jinja2) and the checkpoint's tokenizer; chat needs a chat template in it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import sys
import time
from pathlib import Path

from ..compilation_cache import use_compilation_cache
from .adapter_flags import (add_lora_modules_flags, add_use_flags, check_adapter_dir, lora_modules, use_adapter,
                            use_adapters)
from .balance_flags import add_slot_flags, check_slot_flags
from .speculative_flags import add_speculative_flags, speculative_fields
from .layout_flags import (
    DECODE_SCAN_HELP,
    add_dequantize_flag,
    add_layout_flags,
    add_scan_layers_flag,
    check_no_context_parallel,
    describe_layout,
    distributed_config_from_flags,
    layout_devices,
    layout_given,
    quantize_options,
    scan_layers_from_flags,
)

# Seconds a graceful shutdown gives the requests in flight (then the engine's drain gets as long).
SHUTDOWN_TIMEOUT_S = 30
# --max-model-len when not given: this, or the model's positions if fewer.
DEFAULT_MAX_MODEL_LEN = 2048
# --max-queued-requests when not given: this many per slot (a queue a few batches deep: deeper only adds latency).
QUEUED_PER_SLOT = 4
# `moe_jax.serving.tool_calls.PARSERS`' names (the serving package needs the `serve` extra; --help must not).
TOOL_CALL_PARSERS = ("hermes", "deepseek_v3", "harmony", "llama4_pythonic", "llama4_json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF checkpoint directory, with its tokenizer files")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free one)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id clients name (default: the checkpoint directory's name)")
    parser.add_argument("--max-slots", type=int, default=8,
                        help="requests decoded together: the decode program's rows (default 8)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page (default 16)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help=f"prompt + completion tokens one request may hold (default: {DEFAULT_MAX_MODEL_LEN}, "
                             "or the model's max_position_embeddings if fewer)")
    parser.add_argument("--num-pages", type=int, default=None,
                        help="KV-cache pages in all (default: every slot at --max-model-len)")
    parser.add_argument("--prefill-chunk", type=int, default=128,
                        help="prompt tokens per row of a prefill step (default 128)")
    parser.add_argument("--prefill-rows", type=int, default=1,
                        help="rows of --prefill-chunk prompt tokens a step prefills per data-parallel group; a prompt "
                             "takes as many rows as it fills, the next prompt the rest (default 1)")
    parser.add_argument("--decode-rows", type=parse_row_counts, default=None, metavar="ROWS[,ROWS...]",
                        help="rows per data-parallel group a decode program may have, e.g. 1,4,16: a decode step runs "
                             "the fewest that hold its requests, so a few long requests left do not pay for every "
                             "slot (default: --max-slots per group and its quarters down to 1; the largest is always "
                             "included)")
    parser.add_argument("--mixed-steps", action=argparse.BooleanOptionalAction, default=None,
                        help="a step that prefills a prompt chunk also decodes the running requests, in one program "
                             "(default on, off with --speculative mtp; --no-mixed-steps: a prefill program, then a "
                             "decode program)")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse the keys and values of every full page of the longest prompt prefix an earlier "
                             "request computed (a shared system prompt, a resent conversation) and prefill only the "
                             "rest (default: on where a prompt can fill a page, --page-size <= --max-model-len - 2; "
                             "--prefix-caching: on, refusing a page size no prompt fills; /metrics reports the hit "
                             "rate; --no-prefix-caching: every prompt is prefilled whole)")
    add_speculative_flags(parser)
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="compile the engine's programs before listening, a line for each (default on)")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--compile-cache", default=None, metavar="DIR",
                       help="keep compiled programs in DIR, so a later start reads them back instead of compiling "
                            "them (default: $JAX_COMPILATION_CACHE_DIR if set, else "
                            "$XDG_CACHE_HOME/moe_jax/jax_compilation_cache or ~/.cache/moe_jax/...)")
    cache.add_argument("--no-compile-cache", action="store_true",
                       help="compile every program at every start, keeping none")
    parser.add_argument("--tool-call-parser", default=None, choices=(*TOOL_CALL_PARSERS, "none"),
                        help="the syntax of the model's tool calls, parsed into chat's tool_calls with tool_choice "
                             "\"auto\" (default: the checkpoint's model_type's: hermes for Qwen3 / Qwen2-MoE / OLMoE, "
                             "deepseek_v3, harmony for gpt-oss, llama4_json for Llama 4; none: not parsed)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                        help="uvicorn's log level (info logs each request; default info)")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on every endpoint but /health (default: the "
                             "MOE_JAX_API_KEY environment variable; unset: no key; an empty key is an error)")
    parser.add_argument("--metrics-public", action="store_true",
                        help="serve /metrics without the API key (for a scraper that sends none)")
    parser.add_argument("--allowed-origins", type=parse_origins, default=(), metavar="ORIGIN[,ORIGIN...]",
                        help="browser origins allowed to call the API (CORS), each matched exactly, e.g. "
                             "https://app.example.com; '*' allows any and needs an API key (default: none, every "
                             "cross-origin request is refused)")
    parser.add_argument("--max-request-bytes", type=int, default=None,
                        help="the largest request body; larger ones get 413 (default 8 MiB; never more than the "
                             "largest body a request the context can use takes in JSON, every character escaped)")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="requests that may wait for a slot; beyond it a request gets 429 with Retry-After "
                             f"(default {QUEUED_PER_SLOT} x --max-slots)")
    parser.add_argument("--queue-timeout", type=float, default=None, metavar="SECONDS",
                        help="a request waiting longer than this for a slot gets 503 (default: no limit)")
    parser.add_argument("--drain-timeout", type=float, default=SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
                        help="on SIGTERM / Ctrl-C, how long the running requests may go on before they are ended "
                             f"with an error event (a second signal ends them at once; default {SHUTDOWN_TIMEOUT_S})")
    add_layout_flags(parser, pipeline=False, ep_implementation=True, context="decoding")
    add_slot_flags(parser.add_argument_group("expert load balance"), "engine steps")
    add_scan_layers_flag(parser, DECODE_SCAN_HELP)
    add_dequantize_flag(parser)
    add_use_flags(parser, merge_help="with --adapter: serve the weights with the adapter merged into them (default: "
                                     "unmerged, its factors applied beside the base weights each step)")
    add_lora_modules_flags(parser)


def parse_origins(text: str) -> tuple[str, ...]:
    """`--allowed-origins`' value: "https://a.example,https://b.example" -> the origins (no trailing slash)."""
    origins = tuple(part.strip().rstrip("/") for part in text.split(",") if part.strip())
    bad = [origin for origin in origins if origin != "*" and "://" not in origin]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r}: an origin is scheme://host[:port], e.g. https://app.example.com")
    return origins


def parse_row_counts(text: str) -> tuple[int, ...]:
    """`--decode-rows`' value: "1,4,16" -> (1, 4, 16)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected row counts separated by commas, e.g. 1,4,16") from None


def _check_request(args: argparse.Namespace, limit: int | None) -> int:
    """Errors found without loading anything; returns max_model_len."""
    missing = [name for name in ("fastapi", "uvicorn", "jinja2") if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f'moe-jax serve needs {" and ".join(missing)}, not installed: '
                         f'pip install "moe_jax[serve]"')
    for flag in ("max_slots", "page_size", "prefill_chunk", "prefill_rows", "max_request_bytes"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1.")
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests {args.max_queued_requests} must be >= 0.")
    for flag in ("queue_timeout", "drain_timeout"):
        value = getattr(args, flag)
        if value is not None and not (value > 0 or (flag == "drain_timeout" and value == 0)):
            raise ValueError(f"--{flag.replace('_', '-')} {value} must be a positive number of seconds.")
    if args.decode_rows is not None and not all(1 <= rows <= args.max_slots for rows in args.decode_rows):
        raise ValueError(f"--decode-rows {','.join(map(str, args.decode_rows))}: each must be in [1, --max-slots "
                         f"{args.max_slots}] (rows per data-parallel group).")
    check_slot_flags(args)
    speculative_fields(args)
    _check_access(args)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in [0, 65535].")
    max_model_len = args.max_model_len or min(DEFAULT_MAX_MODEL_LEN, limit or DEFAULT_MAX_MODEL_LEN)
    if max_model_len < 2 or (limit is not None and max_model_len > limit):
        raise ValueError(f"--max-model-len {max_model_len} must be in [2, {limit}] (the model's "
                         "max_position_embeddings).")
    return max_model_len


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else MOE_JAX_API_KEY, else None (no key); without surrounding whitespace (a key file's newline),
    which a bearer token cannot carry."""
    key = args.api_key if args.api_key is not None else os.environ.get("MOE_JAX_API_KEY")
    return None if key is None else key.strip()


def _check_access(args: argparse.Namespace) -> None:
    """Settings that would open the server wider than asked: an empty key (which would turn the key check off),
    and any browser origin without a key (any web page the user visits could drive it)."""
    key = api_key(args)
    if key == "":
        where = "--api-key" if args.api_key is not None else "MOE_JAX_API_KEY"
        raise ValueError(f"{where} is empty: give a key (e.g. `openssl rand -hex 24`), or unset it to run without "
                         "one.")
    if "*" in args.allowed_origins and key is None:
        raise ValueError("--allowed-origins '*' lets any web page call the server: it needs an API key (--api-key "
                         "or MOE_JAX_API_KEY); or list the origins allowed.")


def _listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, so a port in use is an error before the checkpoint loads; it listens once
    the model is ready (until then connections are refused), just before the startup line."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise ValueError(f"--host {host}: {error.strerror}.") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror or error}.") from None
    return sock


def _warm_up(engine, cache: str | None) -> float:
    """Compile every program the engine can run (`ServingEngine.compile_all`: mixed (or prefill) and decode at
    each page-table width) before the port listens, a line on stderr for each. Returns the seconds it took."""
    work = engine.programs_to_compile()
    print(f"compiling {len(work)} programs ({f'compilation cache {cache}' if cache else 'no compilation cache'})",
          file=sys.stderr, flush=True)
    start = last = time.perf_counter()

    def progress(done: int, total: int) -> None:
        nonlocal last
        name, rows, tokens, width = work[done - 1]
        now = time.perf_counter()
        print(f"compiling program {done} of {total}: {name} [{rows} x {tokens}] width {width} ... {now - last:.1f} s",
              file=sys.stderr, flush=True)
        last = now

    engine.compile_all(progress=progress)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    """The job behind `moe-jax serve` (a bad request raises before anything loads; `cli.main` prints it)."""
    import jax

    from ..checkpoint_files import local_checkpoint, read_config
    from ..distributed.mesh import DeviceLayout
    from ..tokenization import load_checkpoint_tokenizer

    check_no_context_parallel(args, "serve")
    directory = Path(args.model)
    if not directory.is_dir():
        raise ValueError(f"--model {directory} is not a checkpoint directory.")
    config = read_config(local_checkpoint(directory))
    check_adapter_dir(args.adapter)
    args.lora_modules = lora_modules(args, args.served_model_name or directory.resolve().name)
    max_model_len = _check_request(args, config.get("max_position_embeddings"))
    tokenizer = load_checkpoint_tokenizer(
        directory, instead="moe-jax serve reads and writes text, so the checkpoint needs its tokenizer files")
    distributed_config = (distributed_config_from_flags(args) if layout_given(args) else
                          _one_device_config(args))
    # Before anything starts JAX: on CPU, layout_devices asks for the virtual devices the layout needs.
    devices = layout_devices(DeviceLayout.from_config(distributed_config).num_devices, "serve")
    cache = False if args.no_compile_cache else args.compile_cache   # set before anything compiles
    if jax.process_index() != 0:   # a multi-process job: process 0 serves, the others run its steps
        use_compilation_cache(cache)
        return _follow(args, directory, distributed_config, devices, max_model_len)
    sock = _listening_socket(args.host, args.port)
    try:
        cache = use_compilation_cache(cache)
        return _serve(args, directory, config, tokenizer, distributed_config, devices, max_model_len, sock, cache)
    finally:
        sock.close()


def _mixed_steps(args) -> bool:
    """--mixed-steps as given; unset: on, except with --speculative mtp (its MTP layer runs in separate prefill and
    decode programs)."""
    return args.mixed_steps if args.mixed_steps is not None else args.speculative != "mtp"


def _engine_config(args, max_model_len: int):
    from ..inference.continuous import ContinuousBatchingConfig

    return ContinuousBatchingConfig(max_slots=args.max_slots, page_size=args.page_size, max_model_len=max_model_len,
                                    num_pages=args.num_pages, prefill_chunk=args.prefill_chunk,
                                    prefill_rows=args.prefill_rows, mixed_steps=_mixed_steps(args),
                                    decode_rows=args.decode_rows, rebalance_every=args.rebalance_every,
                                    prefix_caching=args.prefix_caching, **speculative_fields(args))


def _follow(args, directory: Path, distributed_config, devices, max_model_len: int) -> int:
    """Processes 1.. of a multi-process `serve`: the same model and engine, every step process 0 runs."""
    from ..causal_lm.auto import AutoModelForCausalLM
    from ..inference.continuous import ServingEngine

    model = AutoModelForCausalLM.from_pretrained(directory, distributed_config, devices=devices, progress=False,
                                                 scan_layers=scan_layers_from_flags(args, decoding=True),
                                                 num_redundant_experts=args.num_redundant_experts,
                                                 **quantize_options(args))
    use_adapter(model, args.adapter, args.merge_adapter)
    use_adapters(model, args.lora_modules)
    engine = ServingEngine(model, _engine_config(args, max_model_len))
    if args.warmup:   # as process 0 does before its first message: both reach it within seconds of each other
        engine.compile_all()
    # A launcher's SIGTERM reaches every process: this one keeps running the steps process 0 sends while it drains,
    # and ends when process 0 releases it (if process 0 dies instead, JAX's runtime ends this one).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    steps = engine.follow()
    print(f"stopped: ran the {steps} steps process 0 led", file=sys.stderr, flush=True)
    return 0


def _one_device_config(args):
    from ..distributed.config import DistributedConfig

    return DistributedConfig(tp_size=1, ep_implementation=args.ep_implementation)


def _serve(args, directory: Path, config: dict, tokenizer, distributed_config, devices, max_model_len: int,
           sock, cache: str | None) -> int:
    import uvicorn

    from ..causal_lm.auto import AutoModelForCausalLM
    from ..inference.generation_config import GenerationConfig
    from ..serving import build_app
    from ..serving.guard import LOOPBACK_HOSTS, GuardSettings
    from ..serving.server import CONFIG_LIMITS, draining_server_class, header_timeout_protocol
    from .layout_flags import warn_about_head_split

    model = AutoModelForCausalLM.from_pretrained(directory, distributed_config, devices=devices, progress=False,
                                                 scan_layers=scan_layers_from_flags(args, decoding=True),
                                                 num_redundant_experts=args.num_redundant_experts,
                                                 **quantize_options(args))
    warn_about_head_split(model)
    use_adapter(model, args.adapter, args.merge_adapter)
    use_adapters(model, args.lora_modules)
    generation = GenerationConfig.for_checkpoint(directory, config)
    max_queued = (args.max_queued_requests if args.max_queued_requests is not None
                  else QUEUED_PER_SLOT * args.max_slots)
    manager = model.init_continuous_batching(generation, _engine_config(args, max_model_len), decode=tokenizer.decode,
                                             max_queued=max_queued, queue_timeout=args.queue_timeout)
    manager.engine.lead()   # a multi-process job: the other processes run each step with it (`_follow`)
    try:
        compiled = "programs compile on the first request (--no-warmup)"
        if args.warmup:
            seconds = _warm_up(manager.engine, cache)
            compiled = f"{len(manager.engine.compiled_shapes)} programs compiled in {seconds:.1f} s"
        # The followers' first collective, now that both have compiled; from here on only the engine's thread
        # (started next) talks to them.
        manager.engine.keep_followers_alive()
        manager.start()
        name = args.served_model_name or directory.resolve().name
        guard = GuardSettings(api_key=api_key(args),
                              metrics_public=args.metrics_public, allowed_origins=args.allowed_origins,
                              allowed_hosts=LOOPBACK_HOSTS if _is_loopback(sock.getsockname()[0]) else None,
                              max_request_bytes=args.max_request_bytes)
        app = build_app(manager, tokenizer, model_name=name, max_model_len=max_model_len,
                        drain_timeout=args.drain_timeout, guard=guard, tool_call_parser=args.tool_call_parser)
        sock.listen(2048)   # connections wait in the backlog from now on, until uvicorn accepts them
        host, port = sock.getsockname()[:2]
        engine = manager.engine
        url_host = f"[{host}]" if ":" in host else host
        print(f"serving {name} at http://{url_host}:{port}/v1 ({describe_layout(model.distributed_config)} on "
              f"{len(devices)} {devices[0].platform} device(s); {engine.config.max_slots} slots, max_model_len "
              f"{max_model_len}, {engine.book.total_pages} pages of {engine.config.page_size} tokens; {compiled})",
              file=sys.stderr, flush=True)
        config = uvicorn.Config(app, log_level=args.log_level, lifespan="on", http=header_timeout_protocol(),
                                **CONFIG_LIMITS)
        server = draining_server_class()(config, manager, drain_timeout=args.drain_timeout)
        # uvicorn handles SIGINT / SIGTERM while it runs and restores these handlers after: a signal that arrives
        # while the engine stops is then ignored instead of raising KeyboardInterrupt into its shutdown.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server.run(sockets=[sock])
        if not server.started:
            return 1
    finally:
        manager.stop(timeout=SHUTDOWN_TIMEOUT_S)
        manager.engine.release_followers()
    metrics = manager.metrics()
    if manager.error is not None:
        print(f"error: the engine failed and the server stopped: {type(manager.error).__name__}: {manager.error}",
              file=sys.stderr, flush=True)
        return 1
    print(f"stopped: {metrics['requests_finished']} requests finished, {metrics['generated_tokens']} tokens "
          "generated", file=sys.stderr, flush=True)
    return 0


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"

