"""`splitserve bench serve --dataset-name multi-turn`: conversations whose every turn sends the whole
history so far as a chat request (a system prompt shared by all conversations, `--random-prefix-len`
words; the first question, `--random-input-len`; each later question, `--turn-input-len`; the
answers the server gave, `--random-output-len` tokens each): the traffic that prefix caching, a
cache-aware router and KV tiers are for.

`--num-conversations` conversations of `--num-turns` turns; at most `--max-concurrency`
conversations at once (each sends its next turn when its last answer is in). The report gives time
to first token over all turns, its median by turn, and the prefix-cache hit rate: the prompt tokens
the server says it found cached (usage.prompt_tokens_details.cached_tokens) over all prompt tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

from splitserve.benchmarks.serve_client import WORDS, Outcome, fetch_model, request_headers, send_request


def add_arguments(group) -> None:
    group.add_argument("--num-conversations", type=int, default=32, help="multi-turn: conversations")
    group.add_argument("--num-turns", type=int, default=8, help="multi-turn: turns of each conversation")
    group.add_argument("--turn-input-len", type=int, default=64, help="multi-turn: words of each later question")


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def conversations(ns: argparse.Namespace) -> tuple[str, list[list[str]]]:
    """(the shared system prompt, each conversation's questions)."""
    rng = random.Random(ns.seed)
    system = _words(rng, ns.random_prefix_len)
    questions = [
        [_words(rng, ns.random_input_len if turn == 0 else ns.turn_input_len) for turn in range(ns.num_turns)]
        for _ in range(ns.num_conversations)
    ]
    return system, questions


async def _conversation(session, url, model, headers, ns, system, questions, slots, out) -> None:
    messages = [{"role": "system", "content": system}] if system else []
    async with slots:
        for turn, question in enumerate(questions):
            messages.append({"role": "user", "content": question})
            body = {"model": model, "messages": messages, "max_completion_tokens": ns.random_output_len, "stream": True}
            body.update(temperature=ns.temperature, stream_options={"include_usage": True})
            if ns.ignore_eos:
                body["ignore_eos"] = True
            outcome = await send_request(session, url, body, headers, chat=True)
            out.append((turn, outcome))
            if not outcome.success:
                return  # a conversation cannot go on without its answer
            messages.append({"role": "assistant", "content": outcome.text})


async def _run(ns: argparse.Namespace, base_url: str, headers: dict):
    import aiohttp

    system, questions = conversations(ns)
    cap = ns.max_concurrency or ns.num_conversations
    connector = aiohttp.TCPConnector(limit=cap, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=ns.request_timeout)
    out: list[tuple[int, Outcome]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=True) as session:
        model = ns.model or await fetch_model(session, base_url, headers)
        url = base_url + "/v1/chat/completions"
        print(
            f"Benchmarking {model} at {url}: {ns.num_conversations} conversations x {ns.num_turns} turns, {cap} at once"
        )
        slots, start = asyncio.Semaphore(cap), time.perf_counter()
        await asyncio.gather(
            *(_conversation(session, url, model, headers, ns, system, q, slots, out) for q in questions)
        )
    return model, out, time.perf_counter() - start


def summarize(outcomes: list[tuple[int, Outcome]], duration: float) -> dict:
    done = [(turn, o) for turn, o in outcomes if o.success]
    ttfts = [o.ttft * 1e3 for _, o in done]
    prompt = sum(o.prompt_tokens or 0 for _, o in done)
    cached = sum(o.cached_tokens or 0 for _, o in done)
    by_turn: dict[int, list[float]] = {}
    for turn, o in done:
        by_turn.setdefault(turn, []).append(o.ttft * 1e3)
    return {
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "errors": sorted({o.error for _, o in outcomes if not o.success})[:5],
        "duration_s": duration,
        "median_ttft_ms": statistics.median(ttfts) if ttfts else None,
        "p99_ttft_ms": sorted(ttfts)[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
        "median_ttft_ms_by_turn": {t: statistics.median(v) for t, v in sorted(by_turn.items())},
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "prefix_hit_rate": cached / prompt if prompt else None,
        "output_throughput": sum(o.output_tokens or 0 for _, o in done) / duration if duration else 0.0,
    }


def main(ns: argparse.Namespace) -> dict:
    if min(ns.num_conversations, ns.num_turns, ns.random_input_len, ns.turn_input_len, ns.random_output_len) < 1:
        raise ValueError("multi-turn: conversations, turns and every length must be >= 1")
    base_url = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    headers = request_headers(ns)
    model, outcomes, duration = asyncio.run(_run(ns, base_url, headers))
    result = {"model": model, "base_url": base_url, **summarize(outcomes, duration)}
    print(f"{'requests completed / failed:':<32}{result['completed']} / {result['failed']}")
    for key in ("median_ttft_ms", "p99_ttft_ms", "prefix_hit_rate", "output_throughput", "duration_s"):
        value = result[key]
        print(f"{key + ':':<32}{value:.3f}" if isinstance(value, float) else f"{key + ':':<32}{value}")
    print("median TTFT by turn (ms):", {t: round(v, 1) for t, v in result["median_ttft_ms_by_turn"].items()})
    if result["errors"]:
        print("errors:", result["errors"])
    if ns.save_result:
        path = os.path.join(ns.result_dir or ".", ns.result_filename or f"multi-turn-{int(time.time())}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"Result written to {path}")
    return result
