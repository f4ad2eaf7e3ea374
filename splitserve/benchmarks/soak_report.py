"""`splitserve bench soak`'s verdict: the deployment's memory growth after warm-up (KV cache blocks used
for the first time set apart) against its goal, the report printed at the end, and the problems that
fail the soak (failed requests, memory past the goal, an instance not idle at the end, no request
served after an engine was killed, processes left behind, role switches that lost work)."""

from __future__ import annotations

from collections import Counter

from splitserve.benchmarks import soak_probe as probe
from splitserve.benchmarks import soak_roles

_GOAL_FRACTION, _GOAL_BYTES = 0.02, 50 * 2**20


def memory_growth(samples: list[dict], warmup: float) -> dict:
    """Growth of the deployment's total RSS from the first sample at or after `warmup` to the last,
    less the KV cache blocks used for the first time meanwhile, and whether it stays under the goal
    max(2%, 50 MB)."""
    after = [s for s in samples if s["t_s"] >= warmup] or samples[-1:]
    base, last = after[0], samples[-1]
    kv_growth = last.get("kv_touched_bytes", 0) - base.get("kv_touched_bytes", 0)
    growth = last["total_rss_bytes"] - base["total_rss_bytes"] - kv_growth
    allowed = max(_GOAL_FRACTION * base["total_rss_bytes"], _GOAL_BYTES)
    per_process = {
        pid: last["processes"][pid]["rss_bytes"] - p["rss_bytes"]
        for pid, p in base["processes"].items()
        if pid in last["processes"]
    }
    return {
        "baseline_t_s": base["t_s"],
        "baseline_bytes": base["total_rss_bytes"],
        "final_bytes": last["total_rss_bytes"],
        "kv_first_use_bytes": kv_growth,
        "growth_bytes": growth,
        "allowed_bytes": int(allowed),
        "within_goal": growth <= allowed,
        "per_process_growth_bytes": per_process,
    }


def print_report(result: dict) -> None:
    counts, memory = result["requests"], result["memory"]
    mb = 2**20
    print(f"\nsoak: {result['duration_s']:.0f} s, {result['concurrency']} streams against {result['base_url']}")
    print("requests: " + ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())))
    first = {pid: p for pid, p in result["samples"][0]["processes"].items()}
    last = result["samples"][-1]["processes"]
    print(f"{'process':<34}{'first MB':>10}{'last MB':>10}{'growth MB':>11}  (after warm-up)")
    for pid, p in last.items():
        grown = memory["per_process_growth_bytes"].get(pid)
        start = first.get(pid, p)["rss_bytes"]
        shown = f"{grown / mb:>11.1f}" if grown is not None else f"{'new':>11}"
        print(f"{pid + ' ' + p['name']:<34}{start / mb:>10.1f}{p['rss_bytes'] / mb:>10.1f}{shown}")
    print(
        f"deployment RSS: {memory['baseline_bytes'] / mb:.1f} MB at t={memory['baseline_t_s']:.0f} s -> "
        f"{memory['final_bytes'] / mb:.1f} MB, of which {memory['kv_first_use_bytes'] / mb:.1f} MB KV cache used for "
        f"the first time: growth {memory['growth_bytes'] / mb:+.1f} MB, allowed "
        f"{memory['allowed_bytes'] / mb:.1f} MB ({'within' if memory['within_goal'] else 'OVER'} the goal)"
    )
    idle_mb = result["idle_sample"]["total_rss_bytes"] / mb
    print(f"deployment RSS once idle (t={result['idle_sample']['t_s']:.0f} s): {idle_mb:.1f} MB")
    for url, load in result["idle"].items():
        print(f"idle at the end, {url}: " + ", ".join(f"{k}={v:g}" for k, v in load.items() if v is not None))
    for kill in result.get("kills", []):
        after, began = kill["served_again_after_s"], kill["that_request_began_after_s"]
        print(
            f"kill -9 at t={kill['t_s']:.0f} s of engine {kill['pid']} ({kill['of']}): "
            + (
                f"the first request begun after it to complete ended {after:.2f} s later (it began {began:.2f} s later)"
                if after is not None
                else "NOTHING completed"
            )
        )
    for switch in result.get("role_switches", []):
        after = switch["new_role_work_after_s"]
        print(
            f"role switch at t={switch['t_s']:.0f} s of {switch['url']}: {switch['from']} -> {switch['to']} "
            f"(HTTP {switch['status']}), " + (f"its new role's work {after:.2f} s later" if after is not None else "-")
        )
    if "leftovers" in result:
        print(f"processes left once the deployment was stopped: {result['leftovers'] or 'none'}")
    if result.get("kills"):
        print("memory: not judged (engines were killed and started again)")
    print(f"verdict: {'PASS' if result['passed'] else 'FAIL'} ({'; '.join(result['problems']) or 'no problem found'})")


def problems_of(counts: Counter, memory: dict, idle: dict[str, dict], result: dict) -> list[str]:
    killing = bool(result.get("kills"))
    kinds = ("5xx", "failed", "unexpected 4xx") + (() if killing else ("5xx naming the cause",))
    problems = [f"{counts[kind]} {kind}" for kind in kinds if counts[kind]]
    problems += [] if memory["within_goal"] or killing else ["memory grew past the goal"]
    problems += [f"{url} not idle at the end: {load}" for url, load in idle.items() if not probe.is_idle(load)]
    problems += [
        f"no request completed after the kill at t={k['t_s']} s"
        for k in result.get("kills", [])
        if k["served_again_after_s"] is None
    ]
    problems += (
        [f"processes left after the deployment stopped: {result['leftovers']}"] if result.get("leftovers") else []
    )
    return problems + soak_roles.problems(result.get("role_switches", []))
