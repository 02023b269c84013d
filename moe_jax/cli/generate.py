"""`moe-jax generate`: text in, text out, through the checkpoint's tokenizer and `model.generate`.

    moe-jax generate --model ckpt/ --prompt "Hello" --max-new-tokens 32 --tp 2 --ep 4 --fsdp 4
    moe-jax generate --model ckpt/ --prompt-file prompts.txt          # one prompt per line, one batch
    moe-jax generate --model ckpt/ --prompt-ids 1,2,3                 # token ids in and out: no tokenizer
    moe-jax generate --model ckpt/ --adapter lora/ --prompt "Hello"   # a PEFT LoRA adapter applied (--merge-adapter)

New text streams to the terminal as each step's tokens arrive (one prompt), or each prompt's completion is
printed at the end (several); prefill and decode tokens/s follow, compile time apart. Prompts given as ids
(`--prompt-ids`, or a `--prompt-file` whose every line is ids like `1,2,3`) need no tokenizer, and the
prompt and new ids are printed the same way. A bad request (no checkpoint, text without a tokenizer, an id
outside the vocabulary, a prompt longer than the model's positions, an unknown EP implementation) is one
`error:` line and exit status 2, before anything is compiled.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

from ..tokenization import CheckpointTokenizer, load_checkpoint_tokenizer
from .adapter_flags import add_use_flags, check_adapter_dir, use_adapter
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
    pipeline_options_from_flags,
    quantize_options,
    scan_layers_from_flags,
    warn_about_head_split,
)


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="HF checkpoint directory (with its tokenizer files, for prompts given as text)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file",
                        help="a file with one prompt per line (generated as one batch); when every line is "
                             "token ids like 1,2,3 the prompts are ids, as with --prompt-ids")
    source.add_argument("--prompt-ids",
                        help="the prompt as comma-separated token ids, e.g. 1,2,3 (no tokenizer needed; the "
                             "prompt and the new tokens are printed as ids)")
    parser.add_argument("--max-new-tokens", type=int, default=20, help="tokens to generate (default 20)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=None,
                        help="with --do-sample: divide the logits by this (default: the checkpoint's "
                             "generation_config.json, else 1.0)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="with --do-sample: sample among the k likeliest tokens (default: the "
                             "checkpoint's generation_config.json, else 50)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="with --do-sample: sample among the likeliest tokens whose probabilities sum to "
                             "p (default: the checkpoint's generation_config.json, else 1.0: all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    add_speculative_flags(parser)
    add_layout_flags(parser, ep_implementation=True, context="decoding")
    add_scan_layers_flag(parser, DECODE_SCAN_HELP)
    add_dequantize_flag(parser)
    add_use_flags(parser, merge_help="with --adapter: merge it into the weights first (the same tokens, no adapter "
                                     "work per step)")


# One prompt as token ids: integers separated by commas (spaces allowed around them).
_IDS = re.compile(r"\s*\d+(\s*,\s*\d+)*\s*")


def _parse_ids(text: str, where: str) -> list[int]:
    if not _IDS.fullmatch(text):
        raise ValueError(f"{where} {text!r} is not token ids: give comma-separated integers, e.g. 1,2,3.")
    return [int(token) for token in text.split(",")]


def _read_prompts(args) -> tuple[list, bool]:
    """(prompts, as_ids): the prompt texts, or the prompts' token ids when they were given as ids."""
    if args.prompt_ids is not None:
        return [_parse_ids(args.prompt_ids, "--prompt-ids")], True
    if args.prompt is not None:
        return [args.prompt], False
    path = Path(args.prompt_file)
    if not path.exists() or path.is_dir():
        raise ValueError(f"--prompt-file {path} is not a file.")
    prompts = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompt-file {path} holds no prompt (one per line).")
    if all(_IDS.fullmatch(line) for line in prompts):
        return [_parse_ids(line, f"--prompt-file {path}:") for line in prompts], True
    return prompts, False


def _check_vocabulary(prompts: list[list[int]], vocab_size: int) -> None:
    outside = sorted({token for ids in prompts for token in ids if token >= vocab_size})
    if outside:
        raise ValueError(f"token id {outside[0]} is outside the model's vocabulary [0, {vocab_size}).")


# How prompts given as ids are shown: as they were given, the new ids appended.
IDS_AS_TEXT = CheckpointTokenizer(encode=lambda text: _parse_ids(text, "ids"),
                                  decode=lambda ids: ",".join(str(token) for token in ids))


def _left_padded(rows: list[list[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(row) for row in rows)
    ids = np.full((len(rows), width), pad, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for index, row in enumerate(rows):
        ids[index, width - len(row):] = row
        mask[index, width - len(row):] = 1
    return ids, mask


def run_generate(args: argparse.Namespace) -> int:
    """The job behind `moe-jax generate` (a bad request raises before any compute; `cli.main` prints it)."""
    import jax

    from ..causal_lm.auto import AutoModelForCausalLM
    from ..checkpoint_files import local_checkpoint, read_config
    from ..distributed.config import DistributedConfig
    from ..distributed.mesh import DeviceLayout
    from ..inference.generation_config import GenerationConfig

    check_no_context_parallel(args, "generate")
    directory = Path(args.model)
    if not directory.is_dir():
        raise ValueError(f"--model {directory} is not a checkpoint directory.")
    config = read_config(local_checkpoint(directory))
    check_adapter_dir(args.adapter)
    prompts, as_ids = _read_prompts(args)
    if as_ids:
        tokenizer = IDS_AS_TEXT
        _check_vocabulary(prompts, config["vocab_size"])
    else:
        instead = "give the prompt as token ids with --prompt-ids 1,2,3 (or lines of ids in --prompt-file)"
        tokenizer = load_checkpoint_tokenizer(directory, instead=instead)
        prompts = [tokenizer.encode(text) for text in prompts]
    # Built (and its ep_implementation checked) before anything heavy; without layout flags: one device.
    distributed_config = (distributed_config_from_flags(args) if layout_given(args)
                          else DistributedConfig(tp_size=1, ep_implementation=args.ep_implementation))
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} must be >= 1.")
    speculation = speculative_fields(args)
    if any(not ids for ids in prompts):
        raise ValueError("a prompt encodes to no tokens; give some text.")
    generation = GenerationConfig.for_checkpoint(directory, config).updated(max_new_tokens=args.max_new_tokens)
    longest = max(len(ids) for ids in prompts)
    limit = config.get("max_position_embeddings")
    new_tokens = generation.new_tokens(longest)
    if limit is not None and longest + new_tokens > limit:
        raise ValueError(f"the prompt has {longest} tokens and {new_tokens} new ones are asked for: more than the "
                         f"model's {limit} positions (max_position_embeddings); shorten it or lower --max-new-tokens.")

    devices = layout_devices(DeviceLayout.from_config(distributed_config).num_devices, "generate")
    model = AutoModelForCausalLM.from_pretrained(directory, distributed_config, devices=devices, progress=False,
                                                 scan_layers=scan_layers_from_flags(args, decoding=True),
                                                 **quantize_options(args), **pipeline_options_from_flags(args))
    warn_about_head_split(model)
    use_adapter(model, args.adapter, args.merge_adapter)
    print(f"{describe_layout(model.distributed_config)}; {len(prompts)} prompt(s), up to {new_tokens} new tokens"
          + quantization_note(model)
          + ("" if args.adapter is None else f", adapter {args.adapter}" + (" merged" if args.merge_adapter else "")),
          file=sys.stderr)
    input_ids, attention_mask = _left_padded(prompts, generation.padding_token())
    # In a multi-process job every process generates the same ids; process 0 prints them.
    printing = jax.process_index() == 0
    if args.speculative is not None:
        config_for_call = generation.updated(do_sample=args.do_sample or None, temperature=args.temperature,
                                             top_k=args.top_k, top_p=args.top_p)
        return _generate_speculatively(model, prompts, tokenizer, config_for_call, speculation, args.seed, printing)
    streaming = len(prompts) == 1 and printing
    shown = list(prompts[0])  # the ids decoded so far: new text is decode(all) minus decode(before)
    if streaming:
        sys.stdout.write(tokenizer.decode(shown))

    def stream(step: int, ids: np.ndarray) -> None:
        if streaming and not np.isin(ids[0], generation.eos_token_id):
            before = tokenizer.decode(shown)
            shown.append(int(ids[0]))
            text = tokenizer.decode(shown)
            sys.stdout.write(text[len(before):] if text.startswith(before) else text)
            sys.stdout.flush()

    config_for_call = generation.updated(do_sample=args.do_sample or None, temperature=args.temperature,
                                         top_k=args.top_k, top_p=args.top_p)
    result = model.generator.generate(input_ids, attention_mask, config=config_for_call, seed=args.seed,
                                      on_tokens=stream)
    if streaming:
        sys.stdout.write("\n")
    elif printing:
        for prompt_ids, row in zip(prompts, result.sequences[:, input_ids.shape[1]:]):
            kept = [int(token) for token in row if token not in generation.eos_token_id]
            print(tokenizer.decode(list(prompt_ids) + kept))
    timings = result.timings
    print(f"prefill {timings.prompt_tokens} tokens: {timings.prefill_tokens_per_s:.1f} tokens/s; decode "
          f"{timings.new_tokens} tokens in {timings.steps} steps: {timings.decode_tokens_per_s:.1f} tokens/s; "
          f"compile {timings.compile_s:.1f} s", file=sys.stderr)
    return 0


def _generate_speculatively(model, prompts: list[list[int]], tokenizer, generation, speculation: dict, seed: int,
                            printing: bool) -> int:
    """--speculative: the prompts through continuous batching with speculative decoding; each completion printed
    when all are done, then the steps, the drafts kept and the wall time (its programs compiled on the way)."""
    import time

    from ..inference.batch import batch_config
    from ..inference.continuous import Request
    from ..inference.manager import request_settings

    settings = [request_settings(generation, prompt_length=len(ids), seed=seed + i) for i, ids in enumerate(prompts)]
    engine = model.continuous_batching_engine(batch_config(model, prompts, max(s.max_new_tokens for s in settings),
                                                           **speculation))
    start = time.perf_counter()
    requests = [Request(f"req_{i}", list(ids), s) for i, (ids, s) in enumerate(zip(prompts, settings))]
    for request in requests:
        engine.add(request)
    while engine.has_work():
        engine.step()
    seconds = time.perf_counter() - start
    if printing:
        for request in requests:
            kept = [token for token in request.output.generated_tokens if token not in generation.eos_token_id]
            print(tokenizer.decode(list(request.prompt_ids) + kept))
    new_tokens = sum(len(request.output.generated_tokens) for request in requests)
    steps = engine.steps
    print(f"{new_tokens} new tokens in {sum(steps.values())} steps ({steps['verify']} verifying drafts); drafts "
          f"kept {engine.accepted_draft_tokens} of {engine.draft_tokens} ({engine.acceptance_rate:.0%}); "
          f"{seconds:.1f} s with compilation", file=sys.stderr)
    return 0


def quantization_note(model) -> str:
    """The summary line's word on quantised weights: quantised on load (`--quantize`) or kept (`--no-dequantize`)."""
    if model.kept_quantization is not None:
        return f", {model.kept_quantization} weights kept quantised"
    quantization = model.weight_quantization
    if quantization is None:
        return ""
    return f", {quantization.scheme} weight-only quantised ({', '.join(quantization.modules)})"
