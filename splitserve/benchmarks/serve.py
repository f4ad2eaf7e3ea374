"""`splitserve bench serve`: an online serving benchmark in the manner of `vllm bench serve`, against any
OpenAI-compatible server (splitserve, vLLM, SGLang, llama.cpp ...). It is a client only: it sends random
prompts at a chosen arrival rate, streams every response, and reports TTFT, TPOT, ITL and end-to-end
latency with vLLM's names and units, so that numbers from either tool can be compared line by line.

Prompt lengths. With --tokenizer, /v1/completions prompts are sent as token-id lists, so their lengths are
exact; chat prompts must be text, so random ids are decoded and re-encoded, trimmed or padded for a few
rounds (usually exact, otherwise off by a token or two; the server's chat template adds its own tokens on
top). Without --tokenizer, prompts are random common English words (about one token each). In every case
the reported input and output token counts are the server's `usage` figures when it sends them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import time
from itertools import accumulate

from splitserve.benchmarks import multi_turn, serve_client
from splitserve.benchmarks.serve_client import Outcome, Request, fetch_model, send_request
from splitserve.benchmarks.serve_report import (
    METRICS,
    compute_result,
    latencies_by_priority,
    plot_latencies,
    print_report,
    result_path,
    selected_metrics,
    selected_percentiles,
)
from splitserve.benchmarks.serve_workload import arrival_gaps, make_requests, request_body

DATASETS = ("random", "multi-turn")  # multi-turn: benchmarks/multi_turn.py
BACKENDS = ("openai", "vllm", "openai-chat")


def _schema(text: str) -> dict:
    """argparse type for --guided-json: a JSON object, inline or read from @FILE."""
    if text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    return _json_object(text)


def _json_object(text: str) -> dict:
    """argparse type for --extra-body: a JSON object, refused at parse time when it is anything else."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"top_p\": 0.9}'")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's `bench serve` flags (the ones that apply to the random dataset), with vLLM's defaults
    except --ignore-eos, on by default so that outputs have the requested lengths."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="/v1/completions, or /v1/chat/completions (each prompt sent as one user message)",
    )
    server.add_argument(
        "--backend",
        choices=BACKENDS,
        default="openai",
        help="accepted for vLLM command lines; openai-chat requires a chat --endpoint",
    )
    server.add_argument("--model", help="model name sent in requests (default: the first id of GET /v1/models)")
    server.add_argument("--api-key", help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    server.add_argument("--request-timeout", type=float, default=3600.0, help="seconds allowed per request")
    server.add_argument("--extra-body", type=_json_object, help="JSON object merged into every request body")
    headers = "HTTP headers sent with every request, e.g. endpoint-load-metrics-format=text"
    server.add_argument("--header", nargs="+", type=serve_client.parse_header, metavar="KEY=VALUE", help=headers)
    server.add_argument(
        "--guided-json",
        type=_schema,
        help="a JSON schema (inline, or @FILE) every output must follow (sent as guided_json): structured "
        "output's cost, against a run without it",
    )

    server.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME",
        help="LoRA adapter names the server serves: each request names one of them, at random (seeded), as its model",
    )

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", default="random", help="random, or multi-turn (conversations, chat)")
    multi_turn.add_arguments(data)
    data.add_argument(
        "--tokenizer",
        help="HF directory, hub id or .gguf file: exact prompt lengths and "
        "local token counts (default: random words, the server's usage)",
    )
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1"
    )
    data.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="tokens of one shared prefix put before every prompt (on top of the input length)",
    )
    data.add_argument("--seed", type=int, default=0)

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default inf: all sent at once)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier, > 1 more even",
    )
    load.add_argument("--max-concurrency", type=int, help="most requests in flight at once (default: no cap)")
    load.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos so outputs reach max_tokens; --no-ignore-eos for servers that refuse unknown fields",
    )
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument(
        "--priority-fraction",
        type=float,
        default=0.0,
        help="this share of the requests, spread evenly, is sent with priority -1 (first, on a server started with "
        "--scheduling-policy priority); the report gives their latencies apart from the others'",
    )

    out = parser.add_argument_group("results")
    out.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        help="comma-separated metrics to report, from " + ",".join(METRICS),
    )
    out.add_argument("--metric-percentiles", default="50,99", help="comma-separated percentiles, e.g. 50,90,99")
    out.add_argument("--save-result", action="store_true", help="write the result JSON")
    out.add_argument("--result-dir", help="folder of the result JSON (default: the current one)")
    out.add_argument("--result-filename", help="name of the result JSON (default: from rate, model and date)")
    out.add_argument("--plot", metavar="FILE.png", help="draw histograms and CDFs of the latencies (matplotlib)")
    out.add_argument("--disable-tqdm", action="store_true")


def _is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


def check_arguments(ns: argparse.Namespace) -> None:
    """Refuse a bad configuration before loading a tokenizer or sending anything; ValueError is what the
    CLI turns into a one-line error."""
    if ns.dataset_name not in DATASETS:
        raise ValueError(f"--dataset-name {ns.dataset_name!r} is not supported; choose from {', '.join(DATASETS)}")
    if ns.backend == "openai-chat" and not _is_chat(ns.endpoint):
        raise ValueError("--backend openai-chat needs --endpoint /v1/chat/completions")
    if ns.num_prompts < 1 or ns.random_input_len < 1 or ns.random_output_len < 1 or ns.random_prefix_len < 0:
        raise ValueError(
            "--num-prompts, --random-input-len and --random-output-len must be >= 1, --random-prefix-len >= 0"
        )
    if not 0.0 <= ns.random_range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    if not 0.0 <= getattr(ns, "priority_fraction", 0.0) <= 1.0:
        raise ValueError("--priority-fraction must be in [0, 1]")
    if ns.request_rate <= 0 or ns.burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    unknown = [m for m in selected_metrics(ns) if m not in METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; choose from {list(METRICS)}")
    try:
        percentiles = selected_percentiles(ns)
    except ValueError:
        raise ValueError(f"--metric-percentiles must be numbers, got {ns.metric_percentiles!r}") from None
    if not all(0 <= p <= 100 for p in percentiles):
        raise ValueError("--metric-percentiles must lie in [0, 100]")
    if ns.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None


async def run_requests(
    ns: argparse.Namespace, requests: list[Request], url: str, model: str, headers: dict, session
) -> tuple[list[Outcome], float, int]:
    """Send the requests on their arrival schedule, at most --max-concurrency at a time; returns the outcomes
    in request order, the wall time, and the most requests that were in flight at once."""
    from tqdm.auto import tqdm

    chat = _is_chat(ns.endpoint)
    limit = asyncio.Semaphore(ns.max_concurrency) if ns.max_concurrency else contextlib.nullcontext()
    in_flight = peak = 0
    progress = tqdm(total=len(requests), disable=ns.disable_tqdm, desc="requests")
    pick = random.Random(ns.seed)
    models = [pick.choice(ns.lora_modules) if ns.lora_modules else model for _ in requests]

    async def limited(request: Request, model: str) -> Outcome:
        nonlocal in_flight, peak
        async with limit:
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await send_request(session, url, request_body(request, ns, model, chat), headers, chat)
            finally:
                in_flight -= 1
                progress.update(1)

    gaps = arrival_gaps(len(requests) - 1, ns.request_rate, ns.burstiness, ns.seed)
    start = time.perf_counter()
    tasks = []
    for request, request_model, offset in zip(requests, models, accumulate(gaps, initial=0.0)):
        # Sleeping to absolute times keeps the schedule from drifting by the loop's own delays.
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(request, request_model)))
    outcomes = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    progress.close()
    return list(outcomes), duration, peak


def _fill_token_counts(outcomes: list[Outcome], requests: list[Request], tokenizer) -> None:
    """Counts the server left out of `usage`: the prompt from the dataset, the output from the tokenizer or,
    without one, one token per streamed chunk. Done after the run to keep tokenizing out of the timings."""
    for outcome, request in zip(outcomes, requests):
        if not outcome.success:
            continue
        if outcome.prompt_tokens is None:
            outcome.prompt_tokens = request.prompt_len
        if outcome.output_tokens is None:
            outcome.output_tokens = (
                len(tokenizer.encode(outcome.text, add_special_tokens=False))
                if tokenizer is not None
                else outcome.chunks
            )


async def _benchmark(ns: argparse.Namespace, requests: list[Request], base_url: str, headers: dict):
    """One aiohttp session for the whole run (as vLLM's client), with as many connections as requests may be
    in flight; returns (model, outcomes, duration, peak)."""
    import aiohttp

    cap = ns.max_concurrency or 0  # 0: no limit in aiohttp
    connector = aiohttp.TCPConnector(limit=cap, limit_per_host=cap, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=ns.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=True) as session:
        model = ns.model or await fetch_model(session, base_url, headers)
        url = base_url + "/" + ns.endpoint.lstrip("/")
        print(
            f"Benchmarking {model} at {url}: {len(requests)} requests, rate {ns.request_rate}/s, "
            f"burstiness {ns.burstiness}, max concurrency {ns.max_concurrency}"
        )
        outcomes, duration, peak = await run_requests(ns, requests, url, model, headers, session)
    return model, outcomes, duration, peak


def main(ns: argparse.Namespace) -> dict:
    check_arguments(ns)
    if ns.dataset_name == "multi-turn":
        return multi_turn.main(ns)
    tokenizer = None
    if ns.tokenizer:
        from splitserve.tokenizer import get_tokenizer

        tokenizer = get_tokenizer(ns.tokenizer)
    requests = make_requests(ns, tokenizer, _is_chat(ns.endpoint))
    base_url = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    headers = serve_client.request_headers(ns)
    model, outcomes, duration, peak = asyncio.run(_benchmark(ns, requests, base_url, headers))
    _fill_token_counts(outcomes, requests, tokenizer)
    result = compute_result(ns, outcomes, duration, peak, model, base_url)
    if any(r.priority for r in requests):
        result["by_priority"] = latencies_by_priority(outcomes, [r.priority for r in requests], ns)
    print_report(result, ns)
    if ns.save_result:
        path = result_path(result, ns)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"Result written to {path}")
    if ns.plot:
        plot_latencies(result, outcomes, ns.plot)
        print(f"Latency plots written to {ns.plot}")
    return result
