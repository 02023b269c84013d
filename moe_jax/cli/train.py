"""`moe-jax train`: train an HF MoE checkpoint (or a built-in tiny model) on any layout.

    moe-jax train --steps 100                                   # built-in tiny Qwen3-MoE, synthetic data, 1 device
    moe-jax train --model Qwen3-30B-A3B/ --data tokens.npy --batch-size 32 --fsdp 8 --ep 8 \\
        --checkpoint-dir ckpt/ --save-every 100 --metrics-jsonl metrics.jsonl --export-hf trained/
    moe-jax train ... --resume                                  # continue from the latest checkpoint in ckpt/
    python scripts/train.py ...                                 # the same job without the installed command

Data: `--data FILE.npy` (int token ids [num_sequences, seq_len]; step i trains on rows i*B .. i*B+B-1, wrapping
around), `--text FILE` (tokenised with the checkpoint's tokenizer), or a synthetic stream. Labels are the inputs,
shifted inside the loss as the reference does. Every bad request (data file, sequence length, batch size,
checkpoint directory, layout) is refused with one `error:` line before any compute; the JSONL and TensorBoard files
are opened only once the step has compiled for the first batch and the eval program has traced, and a run that
fails later removes those that hold nothing and says what it kept (`train_progress`). The JSONL has one object per
optimizer step: step, loss (of the batch, before that step's update; includes the router term when the config adds
it), ce_loss, aux_loss, grad_norm, tokens_per_s, capacity, replayed, ...; a resume keeps each step once. A resume
refuses, in one line, a checkpoint of another model or optimizer.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .adapter_flags import add_train_flags, export_adapter, lora_config_from_flags, trainable_from_flags
from .balance_flags import (add_balance_flags, balance_options, check_balance_flags, collapse_remedy,
                            with_router_aux_loss)
from .layout_flags import (
    add_layout_flags,
    check_context_flags,
    add_scan_layers_flag,
    describe_layout,
    distributed_config_from_flags,
    layout_devices,
    layout_given,
    pipeline_options_from_flags,
    scan_layers_from_flags,
    warn_about_head_split,
)
from .run_settings import DECAYING, learning_rate_schedules, run_settings
from .train_checkpoints import (check_export_dir, check_preemption_flags, export_hf, open_checkpoints,
                                preemption_from_flags, starting_state)
from .train_data import check_sequence, eval_source, training_source
from .train_progress import TrainProgress, close_after_failure, forget_records_after

DTYPES = ("float32", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF checkpoint directory (default: a built-in tiny Qwen3-MoE with random weights)")
    parser.add_argument("--steps", type=int, default=10, help="train until this optimizer step (default 10)")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch size in sequences (default 8)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (default: the data file's; 64 for synthetic data)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine", "linear"), default="constant",
                        help="after --warmup-steps of linear warmup: stay at --lr, or decay to --min-lr-ratio x "
                             "--lr at --steps along a cosine or a line (Transformers' schedules; default constant)")
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear warmup from 0 (default 0)")
    parser.add_argument("--min-lr-ratio", type=float, default=0.0,
                        help="the final rate of a cosine or linear schedule over the peak (default 0)")
    parser.add_argument("--lr-decay-steps", type=int, default=None, metavar="N",
                        help="the optimizer updates a cosine or linear schedule decays over (default --steps; then "
                             "it stays at --min-lr-ratio x --lr). A --resume with a larger --steps otherwise "
                             "restarts the decay over the new total: pin it to the first run's length")
    parser.add_argument("--expert-lr", type=float, default=None,
                        help="a separate learning rate for the routed experts (default: --lr)")
    parser.add_argument("--optimizer", choices=("adamw", "muon", "sgd"), default="adamw", help=(
        "adamw (PyTorch's defaults), muon (Muon on the layers' matrices, AdamW on the rest) or sgd (plain SGD)"))
    parser.add_argument("--weight-decay", type=float, default=None, help="decoupled weight decay (default 0)")
    parser.add_argument("--grad-clip", type=float, default=1.0,
                        help="max global gradient norm over all parameters (default 1.0, as HF Trainer; 0 = off)")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    add_layout_flags(parser, ep_implementation=True, context=True)
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--data", default=None,
                      help=".npy file of int token ids [num_sequences, seq_len], or a text corpus (.parquet, "
                           ".jsonl, .array_record with --text-column; .txt: one document per line) tokenised with the "
                           "--model checkpoint's tokenizer")
    data.add_argument("--text", default=None, help="text file, tokenised with the --model checkpoint's tokenizer")
    parser.add_argument("--text-column", default="text", help="the text column of a .parquet / .jsonl corpus "
                                                              "(default text)")
    parser.add_argument("--pack", action="store_true",
                        help="pack a corpus's documents into full rows (segment ids keep attention and the loss "
                             "within each document); default: one document per row, padded")
    parser.add_argument("--data-workers", type=int, default=0,
                        help="Grain worker processes that tokenise a corpus (default 0: in this process, which won "
                             "on a 2-core machine: scripts/bench/bench_data.py; raise it for slow tokenizers on many cores)")
    parser.add_argument("--eval-data", default=None,
                        help="held-out data whose loss and perplexity join the metrics every --eval-every steps "
                             "and after the last: .npy of token ids, a corpus as --data (.parquet, .jsonl, "
                             ".array_record, .txt; cut into rows as --data is, --pack included), or another text "
                             "file cut into rows of --seq-len tokens")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="steps between evaluations (default: after the last step only)")
    parser.add_argument("--eval-batches", type=int, default=None,
                        help="batches of --batch-size per evaluation (default: one pass over --eval-data)")
    parser.add_argument("--tensorboard", default=None, metavar="DIR",
                        help="also write the metrics as TensorBoard event files here (needs tensorboardX)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="one device's peak TFLOP/s at the training dtype: adds MFU to the metrics (model "
                             "TFLOP/s per device are always reported)")
    parser.add_argument("--metrics-jsonl", default=None,
                        help="append one JSON object per optimizer step here (--resume first drops the records of "
                             "the steps after its checkpoint: they are trained, and written, again)")
    parser.add_argument("--checkpoint-dir", default=None, help="orbax train-state checkpoints (saved asynchronously)")
    parser.add_argument("--save-every", type=int, default=100, help="steps between checkpoints (default 100)")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints kept (default 3)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint-dir (none yet: start at step 0), "
                             "so one command serves the first launch and every requeue")
    parser.add_argument("--preemption-signals", default="SIGTERM,SIGUSR1", metavar="NAMES",
                        help="signals that stop the run at the next step boundary with a checkpoint, exit 0 "
                             "(comma-separated; 'none': the default actions)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the built-in model, synthetic data and step keys")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="parameter dtype (default float32)")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="float32 master parameters and optimizer state, bfloat16 compute (needs --dtype float32)")
    parser.add_argument("--offload-optimizer", action="store_true",
                        help="keep the optimizer state in pinned host memory between steps")
    parser.add_argument("--offload-parameters", action="store_true",
                        help="keep the trained parameters in pinned host memory between steps")
    parser.add_argument("--export-hf", default=None, help="write the trained weights here as an HF checkpoint")
    parser.add_argument("--loss-chunk", type=int, default=512, help="positions per lm_head call in the loss")
    add_scan_layers_flag(parser)
    parser.add_argument("--remat", choices=("none", "full", "dots_saveable"), default="none",
                        help="what each layer keeps for the backward pass")
    parser.add_argument("--precompile", action="store_true",
                        help="compile the step (and, with --rebalance-every, the re-placement's forward pass) for "
                             "every rung of the dispatch capacity ladder before the first step, so a capacity "
                             "move never stops the run for a compilation (costs one compilation per rung up front)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_train_flags(parser)
    add_balance_flags(parser)


def _check_positive(args) -> None:
    for flag in ("steps", "batch_size", "grad_accum", "save_every", "keep", "loss_chunk"):
        value = getattr(args, flag)
        if value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {value} must be >= 1.")
    if args.seq_len is not None and args.seq_len < 1:
        raise ValueError(f"--seq-len {args.seq_len} must be >= 1.")
    for flag in ("eval_every", "eval_batches"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {value} must be >= 1.")
        if value is not None and args.eval_data is None:
            raise ValueError(f"--{flag.replace('_', '-')} needs --eval-data (the held-out data to evaluate on).")
    if args.data_workers < 0:
        raise ValueError(f"--data-workers {args.data_workers} must be >= 0.")
    if args.pack and (args.data is None or Path(args.data).suffix == ".npy"):
        raise ValueError("--pack packs a text corpus's documents (--data .parquet / .jsonl / .txt); token rows "
                         "(.npy) are used as they are.")
    if args.grad_clip < 0:
        raise ValueError(f"--grad-clip {args.grad_clip} must be >= 0 (0 turns clipping off).")
    if args.lr_decay_steps is not None:
        if args.lr_decay_steps < 1:
            raise ValueError(f"--lr-decay-steps {args.lr_decay_steps} must be >= 1.")
        if args.lr_schedule not in DECAYING:
            raise ValueError(f"--lr-decay-steps needs a decaying --lr-schedule (cosine or linear); "
                             f"{args.lr_schedule} does not decay.")


def _model_config(args) -> tuple[dict, Path | None]:
    from ..checkpoint_files import read_config
    from .demo import DEMO_CONFIG

    if args.model is None:
        return dict(DEMO_CONFIG), None
    directory = Path(args.model)
    if not directory.is_dir():
        raise FileNotFoundError(f"--model {directory}: not a checkpoint directory.")
    return read_config(directory), directory


def run(args: argparse.Namespace) -> int:
    """The job behind `moe-jax train` (a bad request raises before any compute; `cli.main` prints it)."""
    request = _checked_request(args)
    from ..distributed.runtime import initialize

    initialize()  # only now: a request refused above ends this process before any peer waits on it
    from ..training.loop import TrainLoop
    from ..training.router_health import RouterCollapseWatch

    model, devices = _build_model(args, request.config, request.model_dir)
    if request.lora is not None:
        model.add_adapter(request.lora, seed=args.seed)   # its targets matched here, before any step
    data, eval_data, packing_efficiency = _read_shares(args, model, request.data, request.eval_data)
    train_step = _build_train_step(args, model, request.schedules)
    settings = run_settings(args, data.seq_len)
    checkpoints, saved_record = open_checkpoints(args, model, train_step, settings)
    state, capacity_state = starting_state(args, model, train_step, checkpoints, saved_record, request.model_dir)
    start = int(state.step)
    # Before the first file is written: the step compiled for the first batch (the program the run uses; a layout,
    # input or model the step refuses fails here) and the eval program traced on its first batch.
    _compile_first_step(args, train_step, state, data)
    evaluate, should_evaluate = _evaluation(args, model, train_step, state, eval_data)
    progress = _open_progress(args, model, devices, data, start, packing_efficiency)
    loop = TrainLoop(
        train_step, data, on_step=progress, evaluate=evaluate,
        learning_rate=request.schedules[0] if callable(request.schedules[0]) else lambda step: request.schedules[0],
        should_evaluate=should_evaluate, rebalance_every=args.rebalance_every,
        rebalance_lookahead=args.rebalance_lookahead or 1,
        should_save=lambda step: checkpoints is not None and (checkpoints.should_save(step) or step == args.steps),
        save=checkpoints.save if checkpoints is not None else None, preemption=preemption_from_flags(args),
        router_watch=RouterCollapseWatch(remedy=collapse_remedy(args, request.config), report=progress.warn),
    )
    if args.precompile and loop.next_load is not None:
        ladder = (None,) if state.capacity is None else model.capacity_schedule.ladder   # the step's
        compiled = loop.next_load.precompile(state, data.batch(int(state.data_position)), ladder)
        print(f"compiled the re-placement's forward pass for capacities {list(compiled)} in "
              f"{sum(compiled.values()):.1f} s")
    began = time.perf_counter()
    try:
        with loop.preemption or contextlib.nullcontext():
            state, capacity_state = loop.run(state, args.steps, capacity_state)
    except BaseException:
        close_after_failure(progress, checkpoints, start)
        raise
    progress.close()
    if checkpoints is not None:
        checkpoints.close()
    _print_summary(progress, loop, data, start, int(state.step), time.perf_counter() - began, capacity_state)
    if loop.preempted_at is not None and loop.preempted_at < args.steps:
        print(f"{loop.preemption.signal_name}: stopped at step {loop.preempted_at} of {args.steps}; "
              + (f"saved its checkpoint in {args.checkpoint_dir}: run the same command with --resume to continue"
                 if checkpoints is not None else "nothing saved (no --checkpoint-dir): a rerun starts over"))
        return 0
    params, adapter = train_step.weights(state.params)
    if args.export_adapter is not None:
        export_adapter(args, model, adapter)
    if args.export_hf is not None:
        export_hf(args, model, params if adapter is None else model.merged_params(params, adapter),
                  request.model_dir, settings)
    return 0


@dataclass(frozen=True)
class _Request:
    """What the flags asked for, checked before any compute: the model's config and directory, the data, the
    learning-rate schedules (dense, experts), the LoRA adapter to train (or None)."""

    config: dict
    model_dir: Path | None
    data: Any
    eval_data: Any
    schedules: tuple
    lora: Any = None


def _checked_request(args) -> _Request:
    """Every flag, file and directory checked; nothing started yet."""
    _check_positive(args)
    config, model_dir = _model_config(args)
    check_balance_flags(args, config)
    config = with_router_aux_loss(config, args.router_aux_loss_coef)
    schedules = learning_rate_schedules(args)
    check_context_flags(args, args.seq_len)
    data = training_source(args, config, model_dir)
    check_sequence(data.seq_len, config)
    check_context_flags(args, data.seq_len)
    eval_data = (None if args.eval_data is None else
                 eval_source(args.eval_data, config, model_dir, args.batch_size, data.seq_len, "--eval-data", args))
    check_export_dir(args, args.export_hf, "--export-hf")
    check_preemption_flags(args)
    check_export_dir(args, args.export_adapter, "--export-adapter")
    lora = lora_config_from_flags(args, model_dir)
    if args.resume and args.checkpoint_dir is None:
        raise ValueError("--resume needs --checkpoint-dir (the directory holding the train-state checkpoints).")
    if args.tensorboard is not None and importlib.util.find_spec("tensorboardX") is None:
        raise ValueError('--tensorboard needs tensorboardX, not installed: pip install "moe_jax[tensorboard]".')
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        raise ValueError(f"--peak-tflops {args.peak_tflops} must be > 0.")
    if args.metrics_jsonl is not None and not Path(args.metrics_jsonl).absolute().parent.is_dir():
        raise FileNotFoundError(f"--metrics-jsonl {args.metrics_jsonl}: its directory does not exist.")
    return _Request(config, model_dir, data, eval_data, schedules, lora)


def _build_model(args, config: dict, model_dir=None):
    """(the model on the flags' layout with model_dir's MTP layers, its devices); says which devices it trains on."""
    import jax

    from ..causal_lm.auto import AutoModelForCausalLM
    from ..distributed.mesh import DeviceLayout
    from ..pretrained import checkpoint_mtp_layers
    from ..reporting.picture import count_text

    distributed_config = distributed_config_from_flags(args) if layout_given(args) else None
    if distributed_config is None and jax.process_count() > 1:
        raise ValueError(f"this job has {jax.process_count()} processes and {len(jax.devices())} devices: pass a "
                         "layout (--tp / --fsdp / --ep / --dp-replicate / --cp) that uses all of them.")
    if distributed_config is None:
        devices = jax.devices()[:1]
        seen = count_text(len(jax.devices()), "device")
        print(f"training on 1 {devices[0].platform} device (no layout flag; JAX sees {seen}: pass --tp / "
              "--fsdp / --ep / --dp-replicate to use them)")
    else:
        devices = layout_devices(DeviceLayout.from_config(distributed_config).num_devices, "train")
        print(f"training on {count_text(len(devices), devices[0].platform + ' device')} "
              f"({describe_layout(distributed_config)}, "
              f"ep_implementation={distributed_config.ep_implementation})")
    if distributed_config is None and args.ep_implementation != "auto":
        from ..distributed.config import DistributedConfig

        distributed_config = DistributedConfig(tp_size=1, ep_implementation=args.ep_implementation)
    model_options = dict(devices=devices, dtype=args.dtype, scan_layers=scan_layers_from_flags(args),
                         remat=args.remat, **pipeline_options_from_flags(args))
    model = AutoModelForCausalLM.from_config(config, distributed_config, **model_options,
                                             num_redundant_experts=args.num_redundant_experts,
                                             mtp_layers=checkpoint_mtp_layers(config, model_dir) if model_dir else 0)
    warn_about_head_split(model)
    return model, devices


def _read_shares(args, model, data, eval_data):
    """(data, eval data, the corpus's packing efficiency or None): corpora read now, each process its share of
    every batch (arrays are read whole)."""
    import jax

    from ..training.data import corpus_packing_efficiency, data_shard

    share = None
    if hasattr(data, "load") or hasattr(eval_data, "load"):
        share = data_shard((args.batch_size, data.seq_len), model.batch_sharding())
        data = data.load(share) if hasattr(data, "load") else data
        eval_data = eval_data.load(share) if hasattr(eval_data, "load") else eval_data
        if share.count > 1:
            print(f"process {jax.process_index()} reads share {share.index + 1} of {share.count} of the corpus "
                  f"({len(share.rows)} of the {args.batch_size} rows of each batch)")
    packing_efficiency = corpus_packing_efficiency(data, share) if hasattr(data, "packing_efficiency") else None
    return data, eval_data, packing_efficiency


def offload_from_flags(args) -> str | None:
    """The state kept in host memory between steps: --offload-optimizer and/or --offload-parameters."""
    parts = {"optimizer": args.offload_optimizer, "parameters": args.offload_parameters}
    chosen = [part for part, on in parts.items() if on]
    return None if not chosen else ("all" if len(chosen) == 2 else chosen[0])


def _build_train_step(args, model, schedules):
    from ..training.optimizers import build_optimizer
    from ..training.step import make_train_step

    schedule, expert_schedule = schedules
    optimizer = build_optimizer(args.optimizer, schedule, args.weight_decay, expert_learning_rate=expert_schedule)
    train_step = make_train_step(model, optimizer, grad_accum=args.grad_accum,
                                 grad_clip=args.grad_clip or None, loss_chunk=args.loss_chunk,
                                 mixed_precision=args.mixed_precision or None, offload=offload_from_flags(args),
                                 trainable=trainable_from_flags(args, model), **balance_options(args))
    if not train_step.trainable.everything:
        print(f"training {train_step.trainable.describe()}; the rest of the model is frozen")
    if (error := train_step.batch_size_error(args.batch_size)) is not None:
        raise ValueError(f"--batch-size {args.batch_size}: {error}")
    return train_step


def _compile_first_step(args, train_step, state, data) -> None:
    first_batch = data.batch(int(state.data_position))
    if args.precompile:
        compiled = train_step.precompile(state, first_batch, progress=not args.no_progress)
        print(f"compiled the step for capacities {list(compiled)} in {sum(compiled.values()):.1f} s")
    else:
        train_step.precompile(state, first_batch, [state.capacity], progress=False)


def _evaluation(args, model, train_step, state, eval_data):
    """(evaluate, should_evaluate) for the loop, or (None, None) without --eval-data; the eval program is
    traced on its first batch here."""
    from ..training.evaluation import Evaluator

    if eval_data is None:
        return None, None
    evaluator = Evaluator(model, loss_chunk=args.loss_chunk, compute_dtype=train_step.options.compute_dtype)
    params, adapter = train_step.weights(state.params)
    evaluator.check(params, eval_data, batches=args.eval_batches, adapter=adapter)

    def evaluate(step, state):
        params, adapter = train_step.weights(state.params)
        return evaluator.run(params, eval_data, batches=args.eval_batches, adapter=adapter)

    def should_evaluate(step):
        return step == args.steps or bool(args.eval_every and step % args.eval_every == 0)

    return evaluate, should_evaluate


def _open_progress(args, model, devices, data, start: int, packing_efficiency) -> TrainProgress:
    """The bar and the metric writers. One process of a multi-process job keeps the record: every process sees
    the same metrics."""
    import jax

    from ..training.throughput import train_flops_per_token

    main_process = jax.process_index() == 0
    if args.resume and args.metrics_jsonl is not None and main_process:
        forget_records_after(Path(args.metrics_jsonl), start)
    return TrainProgress(start, args.steps, args.metrics_jsonl if main_process else None,
                         not args.no_progress and main_process, devices=len(devices),
                         flops_per_token=train_flops_per_token(model, data.seq_len), peak_tflops=args.peak_tflops,
                         tensorboard=args.tensorboard if main_process else None,
                         packing_efficiency=packing_efficiency, sparse_layers=model.sparse_layers())


def _print_summary(progress, loop, data, start: int, end: int, seconds: float, capacity_state) -> None:
    if progress.last is None:
        return
    print(f"trained steps {start + 1}-{end} in {seconds:.1f} s: final loss {progress.last['loss']:.4f}, "
          f"{(end - start) * data.batch_size * data.seq_len / seconds:.0f} tokens/s overall, "
          f"{loop.replays} replay(s), capacity {capacity_state.capacity if capacity_state else None}"
          + (f"; eval loss {progress.last['eval_loss']:.4f}, perplexity {progress.last['eval_perplexity']:.2f}"
             if "eval_loss" in progress.last else "")
          + ("" if (balance := progress.balance.summary()) is None else f"; {balance}"))
