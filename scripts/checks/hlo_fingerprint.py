"""Fingerprints of the programs moe_jax compiles, to show a refactor left them unchanged.

    python scripts/checks/hlo_fingerprint.py --out before.json       # on the tree before the change
    python scripts/checks/hlo_fingerprint.py --compare before.json   # after: every program equal, or the diff

For the committed tiny Qwen3-MoE and DeepSeek-V3 on one device, fsdp8/ep8 (all_to_all), tp2/fsdp4/ep4 and
an all_reduce layout: the forward (`model.apply`, inference and training mode, at a dispatch capacity) and the
train step, lowered to StableHLO. Metadata is stripped (source locations, `loc(...)` and the names jax
gives to traced functions), so a program that computes the same thing with the same collectives compares
equal whatever Python moved around it.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from moe_jax import AutoModelForCausalLM, DistributedConfig  # noqa: E402
from moe_jax.training import make_train_step  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models"
LAYOUTS = {
    "one_device": None,
    "fsdp8_ep8_all_to_all": dict(fsdp_size=8, ep_size=8, ep_implementation="all_to_all"),
    "tp2_fsdp4_ep4": dict(tp_size=2, fsdp_size=4, ep_size=4),
    "tp2_fsdp4_ep2_auto": dict(tp_size=2, fsdp_size=4, ep_size=2),   # auto: all_reduce at inference
    "tp2_fsdp2_ep2_all_reduce": dict(tp_size=2, fsdp_size=2, ep_size=2, dp_replicate_size=2,
                                     ep_implementation="all_reduce"),
}
FAMILIES = ("qwen3_moe", "deepseek_v3")

_LOCATION = re.compile(r"\s*loc\((?:[^()]|\([^()]*\))*\)")
_LOCATION_DEFINITION = re.compile(r"^#loc.*$", re.MULTILINE)
_FUNCTION_NAME = re.compile(r"@[\w.$-]+")


def normalise(text: str) -> str:
    """StableHLO text without source locations, and with function symbols numbered by first appearance
    (jax names private functions after the Python functions they trace)."""
    text = _LOCATION_DEFINITION.sub("", _LOCATION.sub("", text))
    names: dict[str, str] = {}
    text = _FUNCTION_NAME.sub(lambda match: names.setdefault(match.group(0), f"@f{len(names)}"), text)
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip())


def programs() -> dict[str, str]:
    """name -> normalised StableHLO of each program checked."""
    found = {}
    for family in FAMILIES:
        for layout_name, layout in LAYOUTS.items():
            config = None if layout is None else DistributedConfig(**layout)
            model = AutoModelForCausalLM.from_pretrained(
                FIXTURES / family, config, devices=jax.devices()[:1] if layout is None else None, progress=False)
            batch = 8
            ids = jnp.ones((batch, 16), jnp.int32)
            capacity = None if model.layout.ep_size == 1 else model.capacity_schedule.ladder[0]
            for inference in (True, False):
                # The jit `model.apply` runs (its private handle: `apply` itself checks and dispatches).
                lowered = model._apply_jit.lower(model.params, ids, capacity=capacity, inference=inference)
                found[f"{family}/{layout_name}/apply_inference={inference}"] = normalise(lowered.as_text())
            train_step = make_train_step(model, optax.adamw(1e-3))
            state = train_step.init_state(seed=0, params=model.params)
            train_batch = {"input_ids": jnp.ones((batch, 17), jnp.int32)}
            found[f"{family}/{layout_name}/train_step"] = normalise(train_step.lower(state, train_batch).as_text())
            print(f"  {family} {layout_name}: lowered", file=sys.stderr)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--out", type=Path, help="write the fingerprints (and texts) to this JSON file")
    action.add_argument("--compare", type=Path, help="compare against fingerprints written with --out")
    args = parser.parse_args(argv)
    texts = programs()
    if args.out:
        args.out.write_text(json.dumps(texts))
        for name, text in texts.items():
            print(f"{hashlib.sha256(text.encode()).hexdigest()[:16]}  {name}")
        return 0
    before = json.loads(args.compare.read_text())
    changed = [name for name in sorted(set(before) | set(texts)) if before.get(name) != texts.get(name)]
    for name in sorted(texts):
        print(f"{'CHANGED' if name in changed else 'same   '}  {name}")
    for name in changed[:3]:
        diff = difflib.unified_diff(before.get(name, "").splitlines(), texts.get(name, "").splitlines(),
                                    "before", "after", lineterm="", n=2)
        print(f"--- {name}\n" + "\n".join(list(diff)[:60]))
    print(f"{len(texts) - len(changed)}/{len(texts)} programs unchanged")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
