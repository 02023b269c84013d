"""bench_serve.py's workloads and the streaming clients that drive a server with them.

A workload is a list of conversations; a conversation is a list of turns, each `{"user": [ids], "max_tokens": n}`.
Turn k's prompt is every earlier turn's user tokens and answer, in order, then its own user tokens: one-turn
conversations are plain requests. Our clients (`drive`) run a conversation's turns in order, appending the answer
the server actually gave (greedy; the word-level text "t12 t45" parsed back to ids), so a resent conversation meets
the pages of its generated tokens in the prefix cache too; the prompts they sent (`transcripts`) are what the
static and reference sides replay.

- random: one turn, prompt lengths uniform in `prompt`, output lengths in `output` (uniform or lognormal).
- shared-prefix: one turn: one system prompt of `system_tokens` tokens shared by every request (and by the
  warm-up, so it is cached when a timed pass starts, as in a server's steady state), then a question of `prompt`
  tokens; short answers.
- multi-turn: `turns` turns per conversation, each a user message of `prompt` tokens and an answer of `output`.
- code-edit: one turn: an instruction (8-16 tokens) then a "file" of `prompt` tokens with repetitive structure
  (functions sharing one skeleton, their identifiers drawn per function), for n-gram (prompt lookup) speculative
  decoding. A request asks for `output` tokens; a model trained on code would copy long spans of the file there.
  A random-weight checkpoint's greedy output does not follow the prompt (what speculation finds there is the
  file's own repeats and the loops the model falls into), so bench_serve's `--size copy --copy-steps 150` first
  trains the checkpoint to copy what it has seen (copy_model.py): its answers then continue the file's pattern, as
  a code model's do. bench_serve prints the server's speculative-decoding metrics (moe_jax_spec_*, verify steps;
  `--server-flags="--speculative ngram"`) and what 3-gram prompt lookup would have proposed on the answers given
  (`lookup_hits`): an estimate, made at the client, of how often these answers let a proposal be accepted (the
  server's proposer matches other n-gram lengths too and proposes several tokens).

Lengths are drawn from `seed` alone; token ids from (`seed`, the pass), so every timed pass does the same work on
fresh prompts and none meets the prefix cache's pages of an earlier pass (the warm-up is pass -1), except the
shared system prompt, drawn from `seed` alone.
"""

from __future__ import annotations

import json
import time

import numpy as np

WORKLOADS = ("random", "shared-prefix", "multi-turn", "code-edit")
# workload -> (prompt or user-message lengths, output lengths) when --prompt / --output are not given
DEFAULT_LENGTHS = {"random": ((16, 256), (16, 128)), "shared-prefix": ((8, 32), (16, 32)),
                   "multi-turn": ((32, 96), (16, 48)), "code-edit": ((256, 512), (64, 128))}
OUTPUT_DISTRIBUTIONS = ("uniform", "lognormal")
FIRST_ID = 3   # ids below are left out of prompts (the tokenizer's unknown token is t0)
SKELETON = 24  # tokens of code-edit's function skeleton, 4 of them identifier slots


def draw_output_length(rng: np.random.Generator, output: tuple[int, int], distribution: str) -> int:
    """One request's output length in [low, high]: uniform, or lognormal with its median at sqrt(low * high) and
    sigma ln(high / low) / 4 (about 95% of draws inside the range before clipping): chat traffic's long tail,
    many short answers and a few long ones (vLLM's ShareGPT runs have that shape)."""
    low, high = output
    if distribution == "uniform":
        return int(rng.integers(low, high + 1))
    if distribution == "lognormal":
        draw = rng.lognormal(np.log(np.sqrt(low * high)), np.log(high / low) / 4)
        return int(np.clip(np.round(draw), low, high))
    raise ValueError(f"output distribution {distribution!r}: expected one of {OUTPUT_DISTRIBUTIONS}")


def conversations(workload: str, count: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int,
                  seed: int, pass_index: int, *, output_distribution: str = "uniform", system_tokens: int = 1024,
                  turns: int = 4) -> list[list[dict]]:
    """`count` requests of `workload` (multi-turn: count // turns conversations of `turns` turns) for timed pass
    `pass_index` (-1: the warm-up)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r}: expected one of {WORKLOADS}")
    lengths = np.random.default_rng(seed)
    ids = np.random.default_rng([seed, pass_index + 1])

    def draw(n: int) -> list[int]:
        return [int(t) for t in ids.integers(FIRST_ID, vocab, n)]

    def length(low_high: tuple[int, int]) -> int:
        return int(lengths.integers(low_high[0], low_high[1] + 1))

    def answer() -> int:
        return draw_output_length(lengths, output, output_distribution)

    if workload == "random":
        return [[{"user": draw(length(prompt)), "max_tokens": answer()}] for _ in range(count)]
    if workload == "shared-prefix":
        system = [int(t) for t in np.random.default_rng([seed, 2**31]).integers(FIRST_ID, vocab, system_tokens)]
        return [[{"user": system + draw(length(prompt)), "max_tokens": answer()}] for _ in range(count)]
    if workload == "multi-turn":
        return [[{"user": draw(length(prompt)), "max_tokens": answer()} for _ in range(turns)]
                for _ in range(max(count // turns, 1))]
    skeleton = draw(SKELETON)   # code-edit: one "language" per pass
    out = []
    for _ in range(count):
        size, code = length(prompt), []
        while len(code) < size:
            function = list(skeleton)
            for slot in (1, 5, 11, 17):   # the function's name and identifiers
                function[slot] = draw(1)[0]
            code += function
        out.append([{"user": draw(length((8, 16))) + code[:size], "max_tokens": answer()}])
    return out


def longest(convs: list[list[dict]]) -> int:
    """The longest context any request of `convs` reaches (every request generates exactly its max_tokens)."""
    return max(sum(len(t["user"]) + t["max_tokens"] for t in conv) for conv in convs)


def requests_count(convs: list[list[dict]]) -> int:
    return sum(len(conv) for conv in convs)


def parse_ids(text: str) -> list[int]:
    """The word-level tokenizer's text ("t12 t45 ...") -> its ids."""
    return [int(word[1:]) for word in text.split()]


def drive(base: str, convs: list[list[dict]], clients: int, api_key: str | None = None) -> list[dict]:
    """`clients` concurrent streaming clients (asyncio and aiohttp in one thread, as vLLM's benchmark client: the
    clients share the machine with the server, so they take as little of its CPU as they can), each taking the next
    conversation when its last one ended and sending its turns in order -> per request, conversation by
    conversation: the prompt sent, max_tokens, the tokens generated and their ids, the prompt tokens the server
    reports cached, time to first token and the gaps between tokens (seconds, at the client, from sending)."""
    import asyncio

    import aiohttp

    results: list[list[dict]] = [[] for _ in convs]

    async def one(session: aiohttp.ClientSession, prompt: list[int], max_tokens: int) -> dict:
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        sent, stamps, text, usage = time.perf_counter(), [], [], {}
        async with session.post(f"{base}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.content:   # the server-sent events, a line at a time
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                if b'"usage":{' in line:
                    usage = json.loads(line[6:])["usage"]
                elif b'"text":""' not in line:
                    stamps.append(time.perf_counter())
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        answer = parse_ids("".join(text))
        return {"prompt": prompt, "max_tokens": max_tokens, "tokens": usage.get("completion_tokens", 0),
                "answer": answer, "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                "ttft": stamps[0] - sent if stamps else float("nan"), "gaps": list(np.diff(stamps))}

    async def main() -> None:
        cursor = iter(range(len(convs)))
        connector = aiohttp.TCPConnector(limit=clients)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600),
                                         headers=headers) as session:
            async def client() -> None:
                for index in cursor:
                    context: list[int] = []
                    for turn in convs[index]:
                        result = await one(session, context + turn["user"], turn["max_tokens"])
                        results[index].append(result)
                        context = result["prompt"] + result["answer"]
            await asyncio.gather(*(client() for _ in range(clients)))

    asyncio.run(main())
    return [result for conv in results for result in conv]


def transcripts(convs: list[list[dict]], results: list[dict]) -> list[list[dict]]:
    """The prompts `drive` sent, as conversations of {"prompt", "max_tokens"} (for the static and reference
    sides to replay)."""
    flat = iter(results)
    return [[{"prompt": next(flat)["prompt"], "max_tokens": turn["max_tokens"]} for turn in conv] for conv in convs]


def lookup_hits(results: list[dict], ngram: int = 3) -> dict:
    """What prompt lookup (n-gram speculation) would have proposed for the answers the server gave: at each
    generated token, the token that followed the latest earlier occurrence of the last `ngram` tokens of the context
    (prompt and answer so far) -> the share of generated tokens with such a proposal and the share of those right.
    Measured at the client on greedy answers, whatever the server runs: what a one-token proposal could accept."""
    proposed = right = tokens = 0
    for result in results:
        context = list(result["prompt"])
        for token in result["answer"]:
            tokens += 1
            key = tuple(context[-ngram:])
            for start in range(len(context) - ngram - 1, -1, -1):
                if tuple(context[start:start + ngram]) == key:
                    proposed += 1
                    right += context[start + ngram] == token
                    break
            context.append(token)
    return {"tokens": tokens, "proposed": proposed / tokens if tokens else float("nan"),
            "right": right / proposed if proposed else float("nan")}
