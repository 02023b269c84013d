"""Weight-only quantisation on load for any family with [E, 2I, H] / [E, H, I] experts
(`from_pretrained(..., quantize="int8" | "fp8")`): which parameters become codes plus scales, how they are
declared, and the experts' forward that decodes them inside the step (`ops.quantized`).

    scheme   codes                 scale                          per
    int8     int8 [..., O, H]      `{name}_scale` [..., O]         output row: amax / 127 over the row
    fp8      float8_e4m3fn         `{name}_scale_inv` [..., ceil(O / 128), ceil(H / 128)]
                                                                   128 x 128 block: amax / 448 (DeepSeek's)

    quantize="fp8", quantize_modules=("experts", "o_proj"), Qwen3-MoE layer 1:
    model.layers.1.mlp.experts.gate_up_proj            [E, 2I, H] float8_e4m3fn
    model.layers.1.mlp.experts.gate_up_proj_scale_inv  [E, 2 ceil(I / 128), ceil(H / 128)] float32
    model.layers.1.self_attn.o_proj.weight             [H, Nq D] float8_e4m3fn
    model.layers.1.self_attn.o_proj.weight_scale_inv   [ceil(H / 128), ceil(Nq D / 128)] float32

The loader quantises each device's block as it reads it (`converters.quantize`): no full-precision copy of a
quantised weight is ever on a device. Inference only, as kept hub formats (training the codes is refused).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..module_tree import ModuleTree, ParamSpec
from ..ops.quantized import FP8Experts, Int8Experts
from .decoder import declare_tree
from .family import KEPT_QUANTIZED_FAMILIES, Family, kept_quantized_family, swiglu

EXPERTS_TARGET = "experts"
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
FP8_BLOCK = (128, 128)
ROUTER_MODULES = ("mlp.gate", "feed_forward.router")   # routing stays in full precision


@dataclass(frozen=True)
class WeightOnlyScheme:
    """One weight-only format: the codes' dtype, the scale parameter's suffix, the scale's shape for a weight of
    `shape`, and the stand-in the grouped matmul reads experts through."""

    name: str
    code_dtype: str
    scale_suffix: str
    scale_shape: Callable[[tuple[int, ...], tuple[int, int]], tuple[int, ...]]   # (weight shape, fp8 block)
    experts_class: type
    # config.json's quantization_config.quant_method an export writes, or None: no format Transformers reads.
    export_method: str | None


def _fp8_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    *lead, rows, columns = shape
    return (*lead, -(-rows // block[0]), -(-columns // block[1]))


WEIGHT_ONLY_SCHEMES: dict[str, WeightOnlyScheme] = {
    "int8": WeightOnlyScheme("int8", "int8", "_scale", lambda shape, block: tuple(shape[:-1]), Int8Experts, None),
    "fp8": WeightOnlyScheme("fp8", "float8_e4m3fn", "_scale_inv", _fp8_grid, FP8Experts, "fp8"),
}


@dataclass(frozen=True)
class WeightQuantization:
    """What `quantize=` / `quantize_modules=` asked for: a scheme of `WEIGHT_ONLY_SCHEMES` and the modules it
    covers ("experts": every sparse layer's routed experts; other names match the layers' linear modules as PEFT's
    `target_modules` do, by their name or its dotted tail, e.g. "o_proj" or "self_attn.q_proj"); `block`: the
    fp8 scale block (128 x 128 when quantising; an FP8 checkpoint's own `weight_block_size` when reading one)."""

    scheme: str
    modules: tuple[str, ...] = (EXPERTS_TARGET,)
    block: tuple[int, int] = FP8_BLOCK

    def __post_init__(self):
        if self.scheme not in WEIGHT_ONLY_SCHEMES:
            raise ValueError(f"quantize={self.scheme!r} is not a weight-only scheme; use one of "
                             f"{sorted(WEIGHT_ONLY_SCHEMES)} (a quantised checkpoint's own format is kept with "
                             "dequantize=False).")
        modules = (self.modules,) if isinstance(self.modules, str) else tuple(self.modules)
        if not modules:
            raise ValueError("quantize_modules is empty; name at least one module (default: 'experts').")
        object.__setattr__(self, "modules", modules)

    @property
    def format(self) -> WeightOnlyScheme:
        return WEIGHT_ONLY_SCHEMES[self.scheme]


def _matches(module: str, target: str) -> bool:
    return module == target or module.endswith("." + target)


def quantized_weights(tree: ModuleTree, modules: Sequence[str]) -> list[str]:
    """The parameters of `tree` that `modules` quantise: experts' fused weights for "experts", the `weight` of
    each matching linear module of the decoder layers; a target that matches nothing is a ValueError naming the
    candidates."""
    linears = {name.rpartition(".")[0]: name for name in quantized_weights_candidates(tree)}
    chosen: list[str] = []
    for target in modules:
        if target == EXPERTS_TARGET:
            found = [name for name in tree.params if ".experts." in name and name.rpartition(".")[2] in EXPERT_WEIGHTS]
        else:
            found = [weight for module, weight in linears.items() if _matches(module, target)]
        if not found:
            tails = sorted({module.split(".", 3)[3] for module in linears})
            raise ValueError(f"quantize_modules names {target!r}, which matches no quantisable module; use "
                             f"{EXPERTS_TARGET!r} or linear modules such as {', '.join(tails)} (routers stay "
                             "unquantised).")
        chosen += [name for name in found if name not in chosen]
    return chosen


def declare_weight_only_storage(tree: ModuleTree, quantization: WeightQuantization) -> None:
    """Rewrite the chosen weights as codes under their own names plus a float32 scale beside each."""
    scheme = quantization.format
    chosen = set(quantized_weights(tree, quantization.modules))
    stored: dict[str, ParamSpec] = {}
    for name, spec in tree.params.items():
        if name not in chosen:
            stored[name] = spec
            continue
        if scheme.name == "fp8" and name.endswith("gate_up_proj"):
            _check_fp8_gate_up(name, spec.shape[-2] // 2, quantization.block[0])
        stored[name] = ParamSpec(spec.shape, scheme.code_dtype, "zeros", keep_dtype=True)
        stored[name + scheme.scale_suffix] = ParamSpec(_scale_shape(scheme, name, spec.shape, quantization.block),
                                                       "float32", "ones", keep_dtype=True)
    tree.params = stored


def _scale_shape(scheme: WeightOnlyScheme, name: str, shape: tuple[int, ...], block: tuple[int, int]):
    """The scale of weight `name`: fused gate_up [.., 2I, H] holds gate's and up's grids one after the other."""
    if scheme.name == "fp8" and name.endswith("gate_up_proj"):
        *lead, rows, columns = shape
        half = scheme.scale_shape((rows // 2, columns), block)
        return (*lead, 2 * half[0], half[1])
    return scheme.scale_shape(shape, block)


def _check_fp8_gate_up(name: str, intermediate: int, rows: int) -> None:
    """Gate and up are quantised as separate matrices; their fused rows find their block only when each half is
    whole blocks (I a multiple of the block's rows) or one power-of-two block."""
    if intermediate % rows and (intermediate > rows or intermediate & (intermediate - 1)):
        raise ValueError(f"quantize='fp8' stores {name}'s gate and up halves in {rows}-row blocks, but the experts' "
                         f"intermediate size {intermediate} is neither a multiple of {rows} nor a power of two below "
                         "it; use quantize='int8' for this model.")


def _not_converted(module: str, patterns: Sequence[str]) -> bool:
    """Transformers' reading of `modules_to_not_convert`: a pattern matching from the start up to a module
    boundary (as a regular expression), or the name's tail."""
    return any(re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module) or module.endswith(pattern)
               for pattern in patterns)


def fp8_checkpoint_quantization(tree: ModuleTree, quantization_config: dict) -> WeightQuantization:
    """The FP8 weights of a FineGrainedFP8 checkpoint (`quant_method: fp8`): the experts and every linear module of
    the layers but its `modules_to_not_convert` (and the routers), in its `weight_block_size`."""
    skipped = quantization_config.get("modules_to_not_convert") or ()
    block = tuple(quantization_config.get("weight_block_size") or FP8_BLOCK)
    experts = {name.rpartition(".")[0] for name in tree.params
               if ".experts." in name and name.rpartition(".")[2] in EXPERT_WEIGHTS}
    linears = {name.rpartition(".")[0] for name in quantized_weights_candidates(tree)}
    chosen = [EXPERTS_TARGET] if experts and not any(_not_converted(module, skipped) for module in experts) else []
    chosen += sorted(module for module in linears if not _not_converted(module, skipped))
    return WeightQuantization("fp8", tuple(chosen), block)


def quantized_weights_candidates(tree: ModuleTree) -> list[str]:
    """The `weight` of every linear module of the decoder layers but the routers."""
    return [name for name, spec in tree.params.items()
            if name.startswith("model.layers.") and name.endswith(".weight") and len(spec.shape) == 2
            and not any(_matches(name.rpartition(".")[0], router) for router in ROUTER_MODULES)]


def supports_weight_only(family: Family) -> bool:
    """Whether `weight_only_family` applies: SwiGLU experts on [E, 2I, H] / [E, H, I], no stored form of its own."""
    return (not family.experts_transposed and family.experts_intermediate_dims is None
            and family.experts_forward is swiglu and family.declare_storage is None)


def weight_only_experts_forward(base: Callable, scheme: WeightOnlyScheme) -> Callable:
    """The family's experts forward with each quantised weight handed over as its stand-in (codes + scale)."""

    def build(config, backend):
        forward = base(config, backend)

        def quantized_experts(hidden, expert_ids, weights, **params):
            for name in [name for name in params if name + scheme.scale_suffix in params]:
                params[name] = scheme.experts_class.checked(params[name], params.pop(name + scheme.scale_suffix),
                                                            hidden.dtype)
            return forward(hidden, expert_ids, weights, **params)

        return quantized_experts

    return build


def weight_only_family(family: Family, quantization: WeightQuantization) -> Family:
    """`family` with `quantization`'s weights held as codes + scales and decoded inside the step."""
    if not supports_weight_only(family):
        raise ValueError(f"quantize={quantization.scheme!r} covers families whose experts are SwiGLU on "
                         f"[E, 2I, H] / [E, H, I] weights; {family.model_type}'s are not. A checkpoint that ships "
                         "quantised (gpt-oss's MXFP4) keeps its own format with dequantize=False.")
    scheme = quantization.format
    declare = family.declare_storage

    def declare_storage(tree: ModuleTree, config) -> None:
        if declare is not None:
            declare(tree, config)
        declare_weight_only_storage(tree, quantization)

    # A scale is split with its experts, as the codes; a linear's scale follows its module's TP rule.
    experts_module = f"layers.*.{family.feed_forward_module}.experts"
    ep_plan = {**(family.ep_plan or {}), **{f"{experts_module}.{weight}{scheme.scale_suffix}": "grouped_gemm"
                                             for weight in EXPERT_WEIGHTS}}
    return dataclasses.replace(family, declare_storage=declare_storage, ep_plan=ep_plan,
                               experts_forward=weight_only_experts_forward(family.experts_forward, scheme))


def kept_quantized(family: Family, config, method: str) -> tuple[Family, WeightQuantization | None]:
    """The family holding a `method` checkpoint's weights as they are stored (`dequantize=False`): the registered
    kept family (gpt-oss MXFP4, DeepSeek-V3 FP8), else, for an FP8 checkpoint of a SwiGLU family (Transformers'
    FineGrainedFP8 format: Qwen3's FP8 releases, this library's `quantize="fp8"` exports), the weight-only twin of
    the weights its `quantization_config` names; with that `WeightQuantization` (None for a registered one)."""
    if (family.model_type, method) in KEPT_QUANTIZED_FAMILIES or method != "fp8" or not supports_weight_only(family):
        return kept_quantized_family(family.model_type, method), None
    quantization_config = config.to_dict().get("quantization_config") or {}
    quantization = fp8_checkpoint_quantization(declare_tree(family, config), quantization_config)
    return weight_only_family(family, quantization), quantization
