"""The figures of `splitserve bench serve`: vLLM's metrics, result-file keys and report layout, and
the latency plots."""

from __future__ import annotations

import argparse
import math
import os
from collections import Counter
from datetime import datetime

import numpy as np

from splitserve.benchmarks.serve_client import Outcome

METRICS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def selected_percentiles(ns: argparse.Namespace) -> list[float]:
    return [float(p) for p in ns.metric_percentiles.split(",") if p.strip()]


def selected_metrics(ns: argparse.Namespace) -> list[str]:
    return [m.strip() for m in ns.percentile_metrics.split(",") if m.strip()]


def _percentile_name(p: float) -> str:
    return str(int(p)) if p == int(p) else str(p)


def summarize(values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    """Mean, median, standard deviation and percentiles in milliseconds (numpy's linear interpolation, as
    vLLM). An empty list gives zeros, as in vLLM, so that result files always hold numbers."""
    values = np.asarray(values_s, dtype=float) * 1000.0 if values_s else np.zeros(1)
    stats = {"mean": float(values.mean()), "median": float(np.median(values)), "std": float(values.std())}
    for p in percentiles:
        stats[f"p{_percentile_name(p)}"] = float(np.percentile(values, p))
    return stats


def _tpot(outcome: Outcome) -> float | None:
    """Decode time per output token after the first; undefined for a single-token output."""
    if outcome.output_tokens is None or outcome.output_tokens < 2:
        return None
    return (outcome.latency - outcome.ttft) / (outcome.output_tokens - 1)


def metric_values(outcomes: list[Outcome]) -> dict[str, list[float]]:
    """Each metric's samples in seconds over the successful requests; ITL pools the gaps of all of them."""
    done = [o for o in outcomes if o.success]
    return {
        "ttft": [o.ttft for o in done],
        "tpot": [t for t in map(_tpot, done) if t is not None],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }


def compute_result(
    ns: argparse.Namespace, outcomes: list[Outcome], duration: float, peak: int, model: str, base_url: str
) -> dict:
    """The figures of the run under vLLM's result-file keys, the per-request lists, and the arguments."""
    done = [o for o in outcomes if o.success]
    input_tokens = sum(o.prompt_tokens for o in done)
    output_tokens = sum(o.output_tokens for o in done)
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": ns.backend,
        "base_url": base_url,
        "endpoint": ns.endpoint,
        "model_id": model,
        "tokenizer_id": ns.tokenizer,
        "num_prompts": len(outcomes),
        "request_rate": "inf" if math.isinf(ns.request_rate) else ns.request_rate,
        "burstiness": ns.burstiness,
        "max_concurrency": ns.max_concurrency,
        "duration": duration,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "max_concurrent_requests": peak,
    }
    values = metric_values(outcomes)
    for metric in selected_metrics(ns):
        for stat, value in summarize(values[metric], selected_percentiles(ns)).items():
            result[f"{stat}_{metric}_ms"] = value
    result |= {
        "input_lens": [o.prompt_tokens or 0 for o in outcomes],
        "output_lens": [o.output_tokens or 0 for o in outcomes],
        "ttfts": [o.ttft for o in outcomes],
        "itls": [o.itl for o in outcomes],
        "e2els": [o.latency for o in outcomes],
        "errors": [o.error for o in outcomes],
        "args": _arguments(ns),
    }
    return result


def latencies_by_priority(outcomes: list[Outcome], priorities: list[int], ns: argparse.Namespace) -> dict:
    """TTFT and E2EL figures (ms) of each priority's successful requests, by priority."""
    groups: dict = {}
    for priority in sorted(set(priorities)):
        mine = [o for o, p in zip(outcomes, priorities) if p == priority]
        values = metric_values(mine)
        figures = {"requests": len(mine)}
        for metric in ("ttft", "e2el"):
            for stat, value in summarize(values[metric], selected_percentiles(ns)).items():
                figures[f"{stat}_{metric}_ms"] = value
        groups[str(priority)] = figures
    return groups


def _arguments(ns: argparse.Namespace) -> dict:
    """The arguments as JSON values: no callables, no API key, and infinity as the string "inf"."""
    args = {k: v for k, v in vars(ns).items() if not callable(v) and k != "api_key"}
    return {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in args.items()}


def print_report(result: dict, ns: argparse.Namespace) -> None:
    """vLLM's report layout: totals and rates, then one block per selected metric."""
    line = "{:<40} {:<10}".format
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    print(line("Successful requests:", result["completed"]))
    print(line("Failed requests:", result["failed"]))
    print(line("Maximum request concurrency:", str(result["max_concurrency"])))
    print(line("Max concurrency reached:", result["max_concurrent_requests"]))
    print(line("Benchmark duration (s):", f"{result['duration']:.2f}"))
    print(line("Total input tokens:", result["total_input_tokens"]))
    print(line("Total generated tokens:", result["total_output_tokens"]))
    print(line("Request throughput (req/s):", f"{result['request_throughput']:.2f}"))
    print(line("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"))
    print(line("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"))
    for metric in selected_metrics(ns):
        name = metric.upper()
        print("{s:{c}^50}".format(s=METRICS[metric], c="-"))
        print(line(f"Mean {name} (ms):", f"{result[f'mean_{metric}_ms']:.2f}"))
        print(line(f"Median {name} (ms):", f"{result[f'median_{metric}_ms']:.2f}"))
        for p in selected_percentiles(ns):
            key = f"p{_percentile_name(p)}"
            print(line(f"{key.upper()} {name} (ms):", f"{result[f'{key}_{metric}_ms']:.2f}"))
    for priority, figures in (result.get("by_priority") or {}).items():
        print("{s:{c}^50}".format(s=f" priority {priority} ({figures['requests']} requests) ", c="-"))
        for metric in ("ttft", "e2el"):
            for stat in ("median", *(f"p{_percentile_name(p)}" for p in selected_percentiles(ns))):
                print(line(f"{stat.capitalize()} {metric.upper()} (ms):", f"{figures[f'{stat}_{metric}_ms']:.2f}"))
    print("=" * 50)
    errors = Counter(e for e in result["errors"] if e)
    if errors:
        print(f"{errors.total()} failed requests; the most frequent errors:")
        for message, count in errors.most_common(5):
            print(f"  {count} x {message}")


def result_path(result: dict, ns: argparse.Namespace) -> str:
    """--result-dir / --result-filename, or vLLM's naming: backend, rate, cap, model and date."""
    name = ns.result_filename
    if not name:
        cap = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency else ""
        model = result["model_id"].rstrip("/").split("/")[-1]
        name = f"{ns.backend}-{result['request_rate']}qps{cap}-{model}-{result['date']}.json"
    return os.path.join(ns.result_dir or ".", name)


def plot_latencies(result: dict, outcomes: list[Outcome], path: str) -> None:
    """One column per metric: its histogram above, its empirical CDF below, in milliseconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = metric_values(outcomes)
    fig, axes = plt.subplots(2, len(METRICS), figsize=(4 * len(METRICS), 7), squeeze=False)
    for column, (metric, title) in enumerate(METRICS.items()):
        samples = np.sort(np.asarray(values[metric]) * 1000.0)
        hist, cdf = axes[0][column], axes[1][column]
        hist.set_title(f"{metric.upper()}: {title}", fontsize=9)
        cdf.set_xlabel(f"{metric.upper()} (ms)")
        if samples.size:
            hist.hist(samples, bins=min(50, max(5, samples.size // 4)))
            cdf.step(samples, np.arange(1, samples.size + 1) / samples.size, where="post")
        cdf.set_ylim(0, 1.01)
        cdf.grid(alpha=0.3)
    axes[0][0].set_ylabel("requests (ITL: gaps)")
    axes[1][0].set_ylabel("fraction <= x")
    fig.suptitle(
        f"{result['model_id']}: {result['completed']} requests, rate {result['request_rate']}/s, "
        f"max concurrency {result['max_concurrency']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
