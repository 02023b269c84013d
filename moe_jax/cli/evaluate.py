"""`moe-jax eval`: the loss and perplexity of a checkpoint on held-out data, on any layout.

    moe-jax eval --model CKPT/ --data heldout.npy --batch-size 8 --fsdp 4 --ep 4
    moe-jax eval --model CKPT/ --data heldout.txt --seq-len 512 --batches 16     # text: the checkpoint's tokenizer
    moe-jax eval --model CKPT/ --data heldout.parquet --text-column text --pack  # a corpus, as `train --data`

Without --batch-size / --seq-len / --pack / --text-column, the data settings are those the training run recorded
beside its --export-hf checkpoint (moe_jax_training.json), so the perplexity is the one its --eval-data reported;
the first line says which settings are in force and where they came from. Then one line for people and one JSON
object (eval_loss, eval_perplexity, eval_tokens, batches) for
scripts. The loss is the mean cross-entropy of every predicted token (`moe_jax.training.Evaluator`: experts at
the largest dispatch capacity, exact).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..checkpoint_files import TRAINING_SETTINGS_FILE
from .layout_flags import (
    add_layout_flags,
    check_context_flags,
    describe_layout,
    distributed_config_from_flags,
    layout_devices,
    layout_given,
    pipeline_options_from_flags,
)
from .run_settings import eval_defaults, read_run_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF checkpoint directory")
    parser.add_argument("--data", required=True,
                        help=".npy of int token ids [rows, seq_len], a corpus (.parquet, .jsonl, .array_record, "
                             ".txt: one document per line, as train --data) or another text file")
    parser.add_argument("--text-column", default=None,
                        help="the text column of a corpus (default: the training run's, else text)")
    parser.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                        help="pack a corpus's documents into full rows, or not (default: as the training run did, "
                             "else one document per row)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="rows per batch (default: the training run's, else 8)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per row (default: the .npy's row length; for text the training run's, else "
                             "512)")
    parser.add_argument("--batches", type=int, default=None, help="batches to evaluate (default: one pass)")
    parser.add_argument("--loss-chunk", type=int, default=512, help="positions per lm_head call (default 512)")
    add_layout_flags(parser, ep_implementation=True, context=True)


def run(args: argparse.Namespace) -> int:
    import jax

    from ..causal_lm.auto import AutoModelForCausalLM
    from ..checkpoint_files import local_checkpoint, read_config
    from ..distributed.mesh import DeviceLayout
    from ..training.data import data_shard
    from ..training.evaluation import Evaluator, num_batches
    from .train_data import eval_source

    for flag in ("batch_size", "batches", "loss_chunk", "seq_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {value} must be >= 1.")
    directory = Path(args.model)
    if not directory.is_dir():
        raise FileNotFoundError(f"--model {directory}: not a checkpoint directory.")
    config = read_config(local_checkpoint(directory))
    text = not str(args.data).endswith(".npy")
    defaults = eval_defaults(args, read_run_settings(directory), text=text)
    args = argparse.Namespace(**{**vars(args), "batch_size": defaults.batch_size, "seq_len": defaults.seq_len,
                                 "pack": defaults.pack, "text_column": defaults.text_column})
    data = eval_source(args.data, config, directory, args.batch_size, args.seq_len, "--data", args)
    print(_settings_line(defaults, data.seq_len, text, directory))
    limit = config.get("max_position_embeddings")
    if limit is not None and data.seq_len > limit:
        raise ValueError(f"rows of {data.seq_len} tokens are longer than the model's max_position_embeddings "
                         f"({limit}); pass --seq-len {limit} or less.")
    check_context_flags(args, data.seq_len)
    distributed_config = distributed_config_from_flags(args) if layout_given(args) else None
    devices = (jax.devices()[:1] if distributed_config is None else
               layout_devices(DeviceLayout.from_config(distributed_config).num_devices, "eval"))
    model = AutoModelForCausalLM.from_pretrained(directory, distributed_config, devices=devices, progress=False,
                                                 **pipeline_options_from_flags(args))
    if args.batch_size % (model.data_parallel_size * model.pipeline_microbatches):
        raise ValueError(f"--batch-size {args.batch_size} must split over the layout's "
                         f"{model.data_parallel_size * model.pipeline_microbatches} data-parallel rows groups.")
    if hasattr(data, "load"):   # a corpus: this process reads its share
        data = data.load(data_shard((args.batch_size, data.seq_len), model.batch_sharding()))
    result = Evaluator(model, loss_chunk=args.loss_chunk).run(model.params, data, batches=args.batches)
    result["batches"] = args.batches or num_batches(data)
    where = "1 device" if distributed_config is None else describe_layout(model.distributed_config)
    print(f"eval loss {result['eval_loss']:.4f}, perplexity {result['eval_perplexity']:.3f} over "
          f"{result['eval_tokens']} predicted tokens ({result['batches']} batches of {args.batch_size} x "
          f"{data.seq_len}; {where})")
    print(json.dumps(result))
    return 0


def _settings_line(defaults, seq_len: int, text: bool, directory: Path) -> str:
    """The data settings in force, and which of them the training run recorded (`run_settings`)."""
    rows = (f"seq len {seq_len}, {'packed' if defaults.pack else 'one document per row'}, text column "
            f"{defaults.text_column}" if text else f"seq len {seq_len} (the .npy's rows)")
    source = (f"; {', '.join(defaults.recorded)} as the training run recorded in {directory / TRAINING_SETTINGS_FILE}"
              if defaults.recorded else "")
    return f"eval settings: batch size {defaults.batch_size}, {rows}{source}"
