"""The `moe-jax` command (also `python -m moe_jax.cli`). Each subcommand is registered in `COMMANDS` with
its parser and handler; the jobs behind them are this package's modules (train, generate, serve, convert,
demo, launch, with the shared layout_flags), imported only when their command runs so `moe-jax --help` stays fast.
Everything a user starts from the command line lives here; the library below never imports it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from ..distributed.targets import CompilerUnavailable
from .adapter_flags import add_plan_flags, lora_config_from_flags
from .layout_flags import (
    add_dequantize_flag,
    add_layout_flags,
    distributed_config_from_flags,
    kept_quantization_from_flags,
    layout_devices,
    pipeline_options_from_flags,
    weight_quantization_from_flags,
)

COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]] = {}


def command(name: str, help_text: str):
    def register(pair):
        add_arguments, run = pair
        COMMANDS[name] = (add_arguments, run, help_text)
        return pair

    return register


def _layout_arguments(parser: argparse.ArgumentParser) -> None:
    add_layout_flags(parser, context=True)
    parser.add_argument("--num-experts", type=int, default=8, help="experts per MoE layer (default 8)")


def _run_layout(args: argparse.Namespace) -> int:
    from ..reporting.picture import layout_picture

    print(layout_picture(distributed_config_from_flags(args), args.num_experts))
    return 0


command("layout", "print which batch, TP position and experts each device holds")((_layout_arguments, _run_layout))


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory or config.json of an HF MoE model")
    add_layout_flags(parser, ep_implementation=True, context=True)
    parser.add_argument("--train", action="store_true",
                        help="also print the bytes of parameters and optimizer state one device holds (builds "
                             "the layout's mesh, on virtual CPU devices if need be; allocates nothing)")
    parser.add_argument("--optimizer", choices=("adamw", "muon", "sgd"), default=None,
                        help="with --train: the optimizer whose state is counted (default adamw)")
    parser.add_argument("--offload-optimizer", action="store_true",
                        help="with --train or --auto: count the optimizer state in host memory between steps "
                             "(--auto: each layout's step compiled with it offloaded)")
    parser.add_argument("--offload-parameters", action="store_true",
                        help="with --train or --auto: count the parameters in host memory between steps")
    add_dequantize_flag(parser)
    add_plan_flags(parser)

    from .plan_auto import add_auto_arguments

    add_auto_arguments(parser)


def _train_memory_text(model, optimizer_name: str, offload: str | None = None) -> str:
    """The train-state memory table of `model` (built on a mesh) with `optimizer_name`'s state, as the train
    step holds it (buffers get no optimizer state; with a LoRA adapter, the adapter's alone)."""
    from ..training.memory import memory_table, train_state_memory
    from ..training.optimizers import build_optimizer, freeze_buffers
    from ..training.state import abstract_train_state

    state = abstract_train_state(model, freeze_buffers(build_optimizer(optimizer_name, learning_rate=1e-3), model))
    adapter = "" if model.adapter_layout is None else f", LoRA r={model.adapter_layout.config.r} adapter trained"
    table = memory_table(train_state_memory(state),
                         f"train state ({optimizer_name}, {model.dtype.name} parameters{adapter})", offload)
    if model.adapter_layout is None:
        return table
    from ..reporting.plan_report import parameter_bytes_text

    return f"{table}\nbeside it, frozen in the model: {parameter_bytes_text(model)}"


def _run_plan(args: argparse.Namespace) -> int:
    from ..causal_lm.auto import AutoModelForCausalLM
    from ..checkpoint_files import read_config
    from ..reporting.plan_report import plan_report

    if args.auto:
        from .plan_auto import run_auto

        return run_auto(args)
    if args.lora_rank is not None and not args.train:
        raise ValueError("--lora-rank counts a LoRA run's train state: add --train.")
    if args.optimizer is not None and not args.train:
        raise ValueError("--optimizer only applies with --train (the train-state memory table).")
    if (args.offload_optimizer or args.offload_parameters) and not args.train:
        raise ValueError("--offload-optimizer / --offload-parameters count where the train state sits: add --train.")
    distributed_config = distributed_config_from_flags(args)
    kept = kept_quantization_from_flags(args, read_config(args.model))
    quantized = weight_quantization_from_flags(args, read_config(args.model))
    if not args.train:
        model = AutoModelForCausalLM.from_config(args.model, distributed_config, abstract=True, dtype=args.dtype,
                                                 kept_quantization=kept, weight_quantization=quantized,
                                                 **pipeline_options_from_flags(args))
        print(plan_report(model))
        return 0
    from ..distributed.mesh import DeviceLayout

    devices = layout_devices(DeviceLayout.from_config(distributed_config).num_devices, "plan")
    model = AutoModelForCausalLM.from_config(args.model, distributed_config, devices=devices, dtype=args.dtype,
                                             kept_quantization=kept, weight_quantization=quantized,
                                                 **pipeline_options_from_flags(args))
    print(plan_report(model))
    print()
    if (lora := lora_config_from_flags(args, None)) is not None:
        model.add_adapter(lora)
    from .train import offload_from_flags

    print(_train_memory_text(model, args.optimizer or "adamw", offload_from_flags(args)))
    return 0


command("plan", "show the resolved plans, each parameter's PartitionSpec and shard shape, and the layout "
                "(--train: the per-device bytes of parameters and optimizer state; --auto: rank every legal "
                "layout of --devices by memory and predicted step time)")(
    (_plan_arguments, _run_plan)
)


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-dir", default=None,
                        help="a new or empty directory to write the tiny checkpoint into, so that `--model "
                             "OUTPUT_DIR` loads it in the other commands (default: a new temporary "
                             "directory)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random weights and of the test batch (default 0)")


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    difference = run_demo(args.output_dir, args.seed)
    return 0 if difference <= 1e-4 else 1


command("demo", "build a tiny Qwen3-MoE checkpoint, load it on 8 devices (tp=2 fsdp=4 ep=4), compare with 1 device")(
    (_demo_arguments, _run_demo)
)


def _job(module: str, add_arguments: str, run: str):
    """(add_arguments, run) of a job module of this package, imported when the command's parser is built or it
    runs, not when `moe_jax.cli` is imported."""

    def add(parser: argparse.ArgumentParser) -> None:
        getattr(importlib.import_module(f"{__name__}.{module}"), add_arguments)(parser)

    def run_job(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(f"{__name__}.{module}"), run)(args)

    return add, run_job


command("convert", "convert parameters between HF safetensors and orbax checkpoints, onto any layout")(
    _job("convert", "add_arguments", "run")
)
command("train", "train an HF MoE checkpoint (or a built-in tiny model) on any layout, with orbax checkpoints")(
    _job("train", "add_arguments", "run")
)
command("eval", "the loss and perplexity of an HF MoE checkpoint on held-out token ids or text, on any layout")(
    _job("evaluate", "add_arguments", "run")
)
command("generate", "generate from an HF MoE checkpoint, text through its tokenizer or token ids "
                    "(--prompt-ids 1,2,3), on any layout, streaming")(
    _job("generate", "add_generate_arguments", "run_generate")
)
command("serve", "serve an HF MoE checkpoint over HTTP with OpenAI's completions and chat API (continuous "
                 "batching, streaming), on any layout without pipeline stages, in one process or several "
                 "(moe-jax launch)")(
    _job("serve", "add_arguments", "run")
)


def _launch_arguments(parser: argparse.ArgumentParser) -> None:
    from .launch import add_arguments

    add_arguments(parser)


def _run_launch(args: argparse.Namespace) -> int:
    from .launch import run

    return run(args)


def _compile_arguments(parser: argparse.ArgumentParser) -> None:
    from .compile import add_compile_arguments

    add_compile_arguments(parser)


def _run_compile(args: argparse.Namespace) -> int:
    from .compile import run_compile

    return run_compile(args)


command("compile", "compile a model's train step or serving programs for a GPU cluster (h100, h200, b200, a100) "
                   "from any machine, and report memory, collectives and kernels (XLA:GPU; needs JAX's CUDA "
                   "plugin, not a GPU)")((_compile_arguments, _run_compile))


command("launch", "run a command as N local processes of one JAX multi-process job (like torchrun), output "
                  "prefixed by process; one failure stops them all")((_launch_arguments, _run_launch))

# Commands main() does not join to the job: the launcher starts no JAX runtime of its own (its processes do),
# and train joins after checking its request, so a bad flag or file fails before any peer waits on it.
NOT_JOINED_BY_MAIN = frozenset({"launch", "train"})


DESCRIPTION = (
    "Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, gpt-oss, DeepSeek-V3, Llama 4) in JAX, "
    "from Hugging Face checkpoints, on any layout of tensor, expert and fully-sharded data parallelism. "
    "Start with `moe-jax demo`; `moe-jax COMMAND --help` explains a command and its flags."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-jax", description=DESCRIPTION)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (add_arguments, _, help_text) in COMMANDS.items():
        subparser = subparsers.add_parser(name, help=help_text, description=help_text)
        add_arguments(subparser)
        subparser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return parser


VERBOSE_HELP = ("also show what is quiet by default: gloo's connection lines under launch, Transformers' notice "
                "that torch is missing, the huge-pages hint (MOE_JAX_VERBOSE=1 in the environment does the same)")


# What a bad request (flags, paths, checkpoints, layouts) raises; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError, NotImplementedError, CompilerUnavailable)


def entry() -> None:
    """The `moe-jax` script and `python -m moe_jax.cli`: restarts once with huge pages for XLA:CPU's host
    buffers where they help (`host_memory`), then runs `main` and exits with its status."""
    from ..host_memory import restart_with_huge_pages

    restart_with_huge_pages(sys.argv[1:])
    sys.exit(main())


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand. A bad request prints one `error: ...` line on stderr and returns 2, as argparse
    does for bad flags; 0 is success, 1 a failed check (the demo's sharded and single-device disagree). A
    failed process of a multi-process job exits with that status at once instead of returning."""
    from ..distributed.runtime import handle_failure, initialize

    args = build_parser().parse_args(argv)
    if args.verbose:
        from ..verbosity import set_verbose

        set_verbose()   # this process and those it starts (moe-jax launch)
    try:
        if args.command not in NOT_JOINED_BY_MAIN:
            initialize()  # joins the job the environment names (moe-jax launch, torchrun, srun); else nothing
        code = COMMANDS[args.command][1](args)
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        code = 2
    if code:
        handle_failure(code)  # a joined process leaves now, not after minutes in JAX's shutdown barrier
    return code

