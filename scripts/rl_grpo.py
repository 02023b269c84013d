"""GRPO on the tiny model, sampler and trainer in one library: it learns to add two small numbers.

    python scripts/rl_grpo.py --steps 40 --metrics-jsonl grpo.jsonl [--tensorboard runs/grpo] [--no-replay]
    python scripts/plot_run.py grpo.jsonl

Each step: --prompts questions "a + b =" (a, b < 8; one token each, the answer one token), --samples completions of
each from the continuous-batching engine (temperature 1, with their log probabilities and, with replay, their
routing), an exact-match reward, advantages normalised within each question's samples
(`rl.group_advantages`), and one train step of the clipped policy objective (`rl.ClippedPolicyObjective`) with
the sampler's routing replayed (`routing_replay=True`). The sampler then runs the new weights in place
(`engine.update_parameters`, no recompilation). One record per step in --metrics-jsonl: reward, loss,
clip_fraction, logprob_gap (train-step vs sampler log probabilities of the sampled tokens, before the update),
routing_mismatch (the share of fed tokens' expert sets the train step's router, left to itself, would change),
grad_norm, seconds. Ends with the mean reward of the first and last 10 steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

MAX_OPERAND = 4                       # a, b in [0, 4): sums 0..6, each one token
PLUS, EQUALS, BOS, EOS = 15, 16, 17, 18
TASK_MODEL = dict(
    model_type="qwen3_moe", vocab_size=24, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=False,
    bos_token_id=BOS, eos_token_id=EOS,
)
PROMPT_LENGTH, ANSWER_LENGTH = 5, 1


def questions(rng, count: int) -> tuple[list[list[int]], np.ndarray]:
    """count prompts [BOS, a, +, b, =] and their answers a + b."""
    pairs = rng.integers(0, MAX_OPERAND, (count, 2))
    return [[BOS, int(a), PLUS, int(b), EQUALS] for a, b in pairs], pairs.sum(axis=1)


def exact_match(outputs, answers) -> np.ndarray:
    return np.array([float(list(o.generated_tokens[:ANSWER_LENGTH]) == [int(a)]) for o, a in zip(outputs, answers)],
                    np.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=16, help="questions per step")
    parser.add_argument("--samples", type=int, default=8, help="completions per question (the GRPO group)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip-eps", type=float, default=0.2)
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("--no-replay", action="store_true", help="let the train step's router choose the experts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metrics-jsonl", type=Path, default=None)
    parser.add_argument("--tensorboard", type=Path, default=None, help="a TensorBoard log directory")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.prompts < 1 or args.samples < 2:
        parser.error("--steps and --prompts must be >= 1 and --samples >= 2 (a group of one has no advantage).")

    import jax
    import optax
    from tqdm.auto import tqdm

    from moe_jax import AutoModelForCausalLM
    from moe_jax.inference import ContinuousBatchingConfig, Request, RequestSettings
    from moe_jax.rl import ClippedPolicyObjective, group_advantages, rollout_batch, routing_mismatch
    from moe_jax.training import make_train_step
    from moe_jax.training.tensorboard import TensorBoardWriter

    model = AutoModelForCausalLM.from_config(dict(TASK_MODEL), devices=jax.devices()[:1])
    model.init_params(seed=args.seed)
    replay = not args.no_replay
    objective = ClippedPolicyObjective(clip_eps=args.clip_eps, kl_coef=args.kl_coef)
    train_step = make_train_step(model, optax.adam(args.lr), objective=objective, routing_replay=replay)
    state = train_step.init_state(seed=args.seed)
    length, count = PROMPT_LENGTH + ANSWER_LENGTH, args.prompts * args.samples
    # The sampler: one engine for the run, its programs compiled once; each step's weights are the train state's.
    engine = model.continuous_batching_engine(ContinuousBatchingConfig(
        max_slots=count, page_size=8, max_model_len=length + 2, prefill_chunk=8))
    rng = np.random.default_rng(args.seed)
    records, sink = [], None if args.metrics_jsonl is None else args.metrics_jsonl.open("w", encoding="utf-8")
    board = None if args.tensorboard is None else TensorBoardWriter(args.tensorboard)
    for step in tqdm(range(args.steps), desc="GRPO", unit="step"):
        start = time.perf_counter()
        engine.update_parameters(state.params)
        assert all(np.array_equal(engine.params[name], state.params[name]) for name in state.params), \
            "the sampler runs the train state's weights"
        prompts, answers = questions(rng, args.prompts)
        requests = [Request(f"s{step}_{i}", prompts[i // args.samples], RequestSettings(
            max_new_tokens=ANSWER_LENGTH, eos_token_id=(EOS,), do_sample=True, temperature=1.0, top_k=0,
            seed=step * count + i, logprobs=True, return_routing=True)) for i in range(count)]
        for request in requests:
            engine.add(request)
        while engine.has_work():
            engine.step()
        outputs = [request.output for request in requests]
        rewards = exact_match(outputs, np.repeat(answers, args.samples))
        batch = rollout_batch(outputs, group_advantages(rewards, args.samples), length=length)
        own = model.apply(state.params, batch["input_ids"], attention_mask=batch["attention_mask"],
                          return_routing=True).routing
        mismatch = routing_mismatch(batch["routing"], np.asarray(own))
        if not replay:
            del batch["routing"]
        state, metrics = train_step(state, batch)
        record = {"step": step + 1, "reward": float(rewards.mean()), "loss": float(metrics["loss"]),
                  "clip_fraction": float(metrics["policy_clipped"]),
                  "logprob_gap": float(metrics["policy_logprob_gap"]), "routing_mismatch": mismatch,
                  "grad_norm": float(metrics["grad_norm"]), "seconds": time.perf_counter() - start}
        if args.kl_coef:
            record["kl"] = float(metrics["policy_kl"])
        records.append(record)
        if sink is not None:
            sink.write(json.dumps(record) + "\n")
            sink.flush()
        if board is not None:
            board(record)
    if sink is not None:
        sink.close()
    if board is not None:
        board.close()
    window = min(10, len(records))
    first = np.mean([r["reward"] for r in records[:window]])
    last = np.mean([r["reward"] for r in records[-window:]])
    print(f"mean reward: first {window} steps {first:.3f}, last {window} steps {last:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
