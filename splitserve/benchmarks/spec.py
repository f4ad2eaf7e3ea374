"""`splitserve bench spec`: speculative decoding against the same engine without it, in one run.

The same greedy requests run through an engine without speculation and then through one with the
--speculative-config given; it prints each side's output tokens/s, the ratio, the acceptance
counters, and how many answers came out identical. Workloads: `copy` (rewrite a text with one
change, edit code, summarise with quotes: the requests that prompt lookup and suffix decoding
serve), `chat` (open questions, the draft model's case), `random` (random token prompts, for
--concurrency 64, where speculation must step aside). --concurrency runs that many requests at once
(1: a single stream, the requests one after another).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import time

from splitserve.engine.arg_utils import EngineArgs

_TEXT = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling after decades of salt and wind. "
    "Every evening the keeper climbed the spiral stairs, one hundred and twelve steps, to light the great lamp. "
    "Ships passing in the night relied on its steady beam to steer clear of the rocks below. In the winter "
    "storms, waves crashed against the base, sending spray high into the air. The keeper kept a logbook of every "
    "vessel he saw, noting its name, its flag, and the time it passed. When the automated light was installed, "
    "the keeper retired to a small cottage in the village, where he still watches the beam sweep across the bay."
)
_CODE = """def parse_config(path):
    with open(path) as f:
        lines = f.readlines()
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config


def save_config(path, config):
    with open(path, "w") as f:
        for key, value in sorted(config.items()):
            f.write(f"{key} = {value}\\n")
"""
WORKLOADS = {
    "copy": [
        f"Repeat the following text word for word, but write 'guardian' instead of 'keeper':\n\n{_TEXT}",
        f"Rename the function parse_config to read_config in this code and print the whole file:\n\n{_CODE}",
        f"Summarise this text, quoting its sentences about the keeper exactly:\n\n{_TEXT}",
    ],
    "chat": [
        "Explain why the sky is blue in a few sentences.",
        "Write a short poem about autumn leaves.",
        "What are three tips for learning a new language?",
    ],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=(*WORKLOADS, "random"), default="copy")
    parser.add_argument("--concurrency", type=int, default=1, help="requests at once (1: one stream)")
    parser.add_argument("--num-prompts", type=int, default=None, help="random workload: prompts (default 64)")
    parser.add_argument("--input-len", type=int, default=128, help="random workload: prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per answer at most")


def main(ns: argparse.Namespace, args: EngineArgs) -> None:
    if not args.speculative_config:
        raise ValueError("bench spec compares an engine with --speculative-config against one without: give it.")
    if ns.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {ns.concurrency}.")
    runs = []
    for config in (None, args.speculative_config):
        runs.append(_run(dataclasses.replace(args, speculative_config=config), ns))
        gc.collect()
    _report(runs, ns, args.speculative_config)


def _run(args: EngineArgs, ns: argparse.Namespace) -> tuple[float, list[list[int]], object]:
    from splitserve.entrypoints.llm import LLM
    from splitserve.sampling_params import SamplingParams

    llm = LLM(**dataclasses.asdict(args))
    inputs = _inputs(llm, ns)
    params = SamplingParams(temperature=0, max_tokens=ns.max_tokens, ignore_eos=ns.workload == "random")
    llm.generate(inputs[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start, outputs = time.perf_counter(), []
    for i in range(0, len(inputs), ns.concurrency):
        batch = llm.generate(inputs[i : i + ns.concurrency], params, use_tqdm=False)
        outputs += [o.outputs[0].token_ids for o in batch]
    elapsed = time.perf_counter() - start
    stats = llm.llm_engine.engine_core.speculator.stats if args.speculative_config else None
    return elapsed, outputs, stats


def _inputs(llm, ns: argparse.Namespace) -> list[dict]:
    if ns.workload == "random":
        vocab = llm.llm_engine.engine_core.config.model_config.vocab_size
        rng = random.Random(0)
        count = ns.num_prompts or 64
        return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(ns.input_len)]} for _ in range(count)]
    tokenizer = llm.get_tokenizer()
    prompts = WORKLOADS[ns.workload] * max(1, ns.concurrency // len(WORKLOADS[ns.workload]))
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    return [{"prompt_token_ids": tokenizer.encode(t, add_special_tokens=False)} for t in texts]


def _report(runs, ns: argparse.Namespace, config) -> None:
    (base_s, base_out, _), (spec_s, spec_out, stats) = runs
    base_tps, spec_tps = sum(map(len, base_out)) / base_s, sum(map(len, spec_out)) / spec_s
    same = sum(a == b for a, b in zip(base_out, spec_out))
    print(f"\nWorkload {ns.workload}, {len(base_out)} requests, concurrency {ns.concurrency}, greedy")
    print(f"{'engine':<24}{'elapsed s':>10}{'output tok/s':>14}")
    print(f"{'no speculation':<24}{base_s:>10.2f}{base_tps:>14.1f}")
    print(f"{'speculative':<24}{spec_s:>10.2f}{spec_tps:>14.1f}")
    print(f"speculative / none: {spec_tps / base_tps:.2f}x; {config}")
    print(f"speculative decoding: {stats.describe()}")
    print(f"identical answers: {same} of {len(base_out)}")
