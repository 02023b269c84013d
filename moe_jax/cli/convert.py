"""`moe-jax convert`: Hugging Face safetensors <-> orbax parameter checkpoints.

    moe-jax convert --from hf --to orbax Qwen3-30B-A3B/ qwen3-orbax/ --fsdp 8 --ep 8
    moe-jax convert --from orbax --to hf qwen3-orbax/ qwen3-hf/ --tp 2 --fsdp 4 --ep 4
    moe-jax convert --from hf --to hf base/ merged/ --merge-adapter lora/   # a PEFT LoRA adapter merged in
    python scripts/convert.py ...            # the same job without the installed command

The parameters are held on the layout given by the layout flags while they pass through (default: one
device): sharded as they are read, never whole on one device. An orbax checkpoint written on one layout
restores onto any other. `--dtype` casts the parameters on the way (default: the source checkpoint's dtype). The
tokenizer files, chat template and generation config travel with them, byte for byte, both ways.

On a CPU-only machine a layout of N devices uses N virtual CPU devices: the job asks XLA for them before JAX
starts (`XLA_FLAGS=--xla_force_host_platform_device_count=N`); if JAX has already started with fewer, it says so.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .layout_flags import (
    add_dequantize_flag,
    add_layout_flags,
    describe_layout,
    distributed_config_from_flags,
    layout_devices,
)

FORMATS = ("hf", "orbax")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="source_format", choices=FORMATS, required=True,
                        help="format of SRC: hf (safetensors + config.json) or orbax (written by --to orbax)")
    parser.add_argument("--to", dest="target_format", choices=FORMATS, required=True, help="format to write DST in")
    parser.add_argument("source", metavar="SRC", help="checkpoint directory to read")
    parser.add_argument("destination", metavar="DST", help="directory to create (absent or empty)")
    add_layout_flags(parser, pipeline=False, what=" of the layout holding the parameters")
    # Checked by parameter_dtype (not argparse choices), so the flag and the Python API give the same error.
    parser.add_argument("--dtype", default=None,
                        help="parameter dtype to write: float32, bfloat16 or float16 (default: the source's)")
    add_dequantize_flag(parser)
    parser.add_argument("--merge-adapter", default=None, metavar="DIR",
                        help="merge this LoRA adapter (PEFT's adapter_config.json + adapter_model.safetensors) into "
                             "the parameters before writing them: W + scaling * B A, as PEFT's merge_and_unload")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def run(args: argparse.Namespace) -> int:
    """The job behind `moe-jax convert` (a bad request or checkpoint raises; `cli.main` prints it)."""
    distributed_config = distributed_config_from_flags(args)
    convert(args.source_format, args.target_format, args.source, args.destination, distributed_config,
            dtype=args.dtype, progress=not args.no_progress, dequantize=args.dequantize,
            merge_adapter=args.merge_adapter, quantize=args.quantize, quantize_modules=args.quantize_modules)
    return 0


def convert(source_format: str, target_format: str, source, destination, distributed_config=None, *,
            dtype: str | None = None, progress: bool = True, dequantize: bool = True, merge_adapter=None,
            quantize: str | None = None, quantize_modules=None) -> Path:
    """Read `source` in `source_format` onto the layout of `distributed_config`, write `destination` in
    `target_format` (with the LoRA adapter in directory `merge_adapter` merged in; quantised on the way with
    `quantize`, as `from_pretrained`'s). Returns `destination`."""
    from ..distributed.config import DistributedConfig
    from ..distributed.mesh import DeviceLayout
    from ..parameter_dtypes import parameter_dtype
    from .adapter_flags import check_adapter_dir, use_adapter

    source, destination = Path(source), Path(destination)
    for name, value in (("source format", source_format), ("target format", target_format)):
        if value not in FORMATS:
            raise ValueError(f"Unknown {name} {value!r}; use one of {list(FORMATS)}.")
    if dtype is not None:
        parameter_dtype(dtype)
    _check_source(source)
    _check_destination(destination)
    check_adapter_dir(merge_adapter, "--merge-adapter")
    distributed_config = distributed_config or DistributedConfig()
    devices = layout_devices(DeviceLayout.from_config(distributed_config).num_devices, "convert")

    print(f"[1/2] reading the {source_format} checkpoint {source} onto {len(devices)} {devices[0].platform} "
          f"device(s) ({describe_layout(distributed_config)})")
    start = time.perf_counter()
    model = load_model(source_format, source, distributed_config, devices, dtype=dtype, progress=progress,
                       dequantize=dequantize, quantize=quantize, quantize_modules=quantize_modules)
    print(f"      {len(model.hf_params())} parameters, {parameter_bytes(model.params) / 2**20:.1f} MiB "
          f"{model.dtype.name}, in {time.perf_counter() - start:.1f} s")
    if merge_adapter is not None:
        use_adapter(model, str(merge_adapter), True, "--merge-adapter")
        print(f"      merged the LoRA adapter {merge_adapter} ({len(model.hf_params())} parameters, the same shapes)")

    print(f"[2/2] writing the {target_format} checkpoint {destination}")
    start = time.perf_counter()
    save_model(target_format, model, destination, progress=progress)
    carried = _carry_companion_files(source, destination)
    print(f"      done in {time.perf_counter() - start:.1f} s"
          + (f"; carried {', '.join(carried)}" if carried else ""))
    return destination


def _carry_companion_files(source: Path, destination: Path) -> list[str]:
    """The source's tokenizer, chat template and generation config, copied as they are (process 0 writes, as
    it wrote the weights), so `generate --prompt` and `serve` work on either form."""
    import jax

    from ..checkpoint_files import copy_companion_files

    return copy_companion_files(source, destination) if jax.process_index() == 0 else []


def load_model(source_format: str, source: Path, distributed_config, devices, *, dtype: str | None = None,
               progress: bool = True, dequantize: bool = True, quantize: str | None = None, quantize_modules=None):
    """The model of `source`, built on `devices` with `distributed_config`, its parameters read into place."""
    from converters.orbax_params import PARAMS_DIR_NAME, read_orbax_config, restore_orbax_params, stored_shapes

    from ..causal_lm.auto import AutoModelForCausalLM
    from ..causal_lm.families import model_class_for
    from ..models.mtp import held_mtp_layers
    from ..pretrained import checkpoint_dtype, quantization_method

    if source_format == "hf":
        return AutoModelForCausalLM.from_pretrained(source, distributed_config, devices=devices, dtype=dtype,
                                                    progress=progress, dequantize=dequantize, quantize=quantize,
                                                    quantize_modules=quantize_modules)
    if quantize is not None:
        raise ValueError("--quantize quantises a Hugging Face checkpoint as it is read; an orbax source is read as "
                         "it was written: convert it to hf first, then quantise that.")
    config = read_orbax_config(source)
    kept = None if dequantize else quantization_method(config, source)
    # The multi-token-prediction layers the parameters hold (`models.mtp`), as from_pretrained counts them.
    values = model_class_for(config).config_class.from_dict(config)
    mtp_layers = held_mtp_layers(values, stored_shapes(source / PARAMS_DIR_NAME))
    model = AutoModelForCausalLM.from_config(config, distributed_config, devices=devices, mtp_layers=mtp_layers,
                                             dtype=dtype or checkpoint_dtype(config), kept_quantization=kept)
    model.set_params(restore_orbax_params(source, model))
    return model


def save_model(target_format: str, model, destination: Path, *, progress: bool = True) -> None:
    from converters.orbax_params import save_orbax_params

    from ..pretrained import saved_config

    if target_format == "hf":
        model.save_pretrained(destination, progress=progress)
    else:
        save_orbax_params(model.hf_params(), destination, config=saved_config(model))


def parameter_bytes(params: dict) -> int:
    return sum(array.size * array.dtype.itemsize for array in params.values())


def _check_source(source: Path) -> None:
    if not source.exists():
        raise FileNotFoundError(
            f"Source {source} does not exist. Pass a local checkpoint directory (for a Hugging Face Hub model, "
            "download it first: huggingface-cli download REPO_ID --local-dir DIR)."
        )
    if not source.is_dir():
        raise NotADirectoryError(f"Source {source} is a file; pass the checkpoint directory that holds config.json.")


def _check_destination(destination: Path) -> None:
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise FileExistsError(
            f"Destination {destination} already exists and is not an empty directory; choose a new directory "
            "or remove it first."
        )
