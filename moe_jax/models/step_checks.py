"""The host-side checks of one step call (shapes and layouts only, never device values): what `apply`, the
train step, the generator and the NNX face run at their boundary before tracing the model's math."""

from __future__ import annotations

NO_PARAMS = "The model has no parameters: call init_params(), set_params() or from_pretrained() first."


def check_cache(cache, shape: tuple[int, ...], layer_stack) -> None:
    """A KV cache fits a call of input_ids `shape` [B, S] and was built for this layer stacking."""
    if cache.batch_size != shape[0]:
        raise ValueError(f"the cache holds {cache.batch_size} rows but input_ids has {shape[0]}; build it with "
                         f"init_cache(model, batch={shape[0]}, ...).")
    if shape[1] > cache.max_length:
        raise ValueError(f"{shape[1]} new tokens do not fit a cache of {cache.max_length} slots.")
    missing = {key for key, _, _ in layer_stack.cache_entries()} - cache.keys.keys()
    if missing:
        raise ValueError(f"the cache has no keys for layer run(s) {sorted(missing)}: it was built for another "
                         "model or layer stacking (scanned runs, pipeline stages); build it with "
                         "init_cache(model, ...).")


def check_params(params, layer_stack, hf_names) -> None:
    """`params` are in the storage layout of `layer_stack` (scanned runs stacked); `hf_names`: the per-layer HF
    names, to say so when params come in that layout instead."""
    if params is None:
        raise ValueError(NO_PARAMS)
    expected = layer_stack.members.keys()
    if params.keys() != expected:
        hf_layout = params.keys() == hf_names
        raise ValueError(
            "params do not have this model's storage layout"
            + (" (they are per-layer HF names; pass model.layer_stack.stack(params), or use set_params)"
               if hf_layout else
               f": missing {sorted(expected - params.keys())[:5]}, unexpected {sorted(params.keys() - expected)[:5]}")
            + "."
        )


def check_batch(shape: tuple[int, ...], data_parallel_size: int, microbatches: int = 1) -> None:
    """input_ids' `shape` is [B, S] with B split evenly over the data-parallel groups (and, with pipeline stages,
    into `microbatches` microbatches each split over them)."""
    if len(shape) != 2:
        raise ValueError(f"input_ids must be [batch, sequence], got shape {tuple(shape)}.")
    if microbatches > 1 and shape[0] % (microbatches * data_parallel_size):
        raise ValueError(
            f"batch size {shape[0]} cannot be cut into {microbatches} pipeline microbatches each split over the "
            f"{data_parallel_size} data-parallel groups; use a multiple of {microbatches * data_parallel_size} "
            "(pipeline_microbatches x the data-parallel size), or another pipeline_microbatches.")
    if shape[0] % data_parallel_size:
        raise ValueError(
            f"batch size {shape[0]} cannot be split over the {data_parallel_size} data-parallel groups "
            f"of this layout; use a multiple of {data_parallel_size} (forward() pads for you)."
        )
