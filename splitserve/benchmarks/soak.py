"""`splitserve bench soak`: a long run of mixed traffic against a deployment, to show leaks.

`--concurrency` client streams each send one request after another for `--duration` seconds: most
are ordinary completions and chats (streamed or not, prompt and output lengths drawn at random),
some are abandoned by the client after a few streamed chunks (an abort the server must clean up),
some are invalid on purpose (each must be refused with a 4xx). Every `--sample-interval` seconds
the resident memory (RSS) of every process of the deployment is read from /proc. At the end the
soak waits for every instance to go idle and reports: the memory growth from the first sample after
`--warmup` to the last, against the goal max(2%, 50 MB); the KV cache still in use once idle (must
be 0); and the count of 5xx answers and other failures (must be 0).

With --kill-engine-every SECONDS the soak also kills (SIGKILL) one engine process of the deployment,
chosen at random, that often, to check that the deployment heals (docs/serving.md "What happens
when a process dies"): a request may then fail only with a 5xx (or a stream's error event) that
names the cause; the report gives, per kill, the seconds until a request begun after the kill
completed; memory is reported but not judged (the killed processes' memory goes with them); and
once the deployment the soak started is stopped, no process of it may be left.

With --switch-roles-every SECONDS (a PD deployment) it moves one instance to another PD role that
often, through the router, and no request may fail for it (soak_roles.py).

Without --base-url the soak starts the deployment itself (`splitserve serve [--pd XpYd]`), so it
knows every process; with --base-url it needs --pid, the deployment's root process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import time
from collections import Counter

from splitserve.benchmarks import soak_probe as probe
from splitserve.benchmarks import soak_roles
from splitserve.benchmarks.soak_report import memory_growth, print_report, problems_of
from splitserve.benchmarks.soak_traffic import run_stream
from splitserve.disagg.launch import LocalInstance, start_instance, wait_healthy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    parser.add_argument("--concurrency", type=int, default=16, help="client streams, each one request at a time")
    parser.add_argument("--sample-interval", type=float, default=60.0, help="seconds between RSS samples")
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds before the baseline RSS sample")
    parser.add_argument("--max-input-len", type=int, default=512, help="prompt lengths uniform in [4, this] words")
    parser.add_argument("--max-output-len", type=int, default=256, help="max_tokens uniform in [1, this]")
    parser.add_argument("--abort-fraction", type=float, default=0.1, help="requests the client abandons mid-stream")
    parser.add_argument("--error-fraction", type=float, default=0.1, help="invalid requests (each must get a 4xx)")
    parser.add_argument("--idle-timeout", type=float, default=120.0, help="seconds allowed to go idle at the end")
    parser.add_argument(
        "--kill-engine-every",
        type=float,
        metavar="SECONDS",
        help="kill -9 one engine process of the deployment this often, to check that it heals",
    )
    parser.add_argument(
        "--switch-roles-every",
        type=float,
        metavar="SECONDS",
        help="a PD deployment: switch one instance's PD role through the router this often (docs/pd.md)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-result", metavar="FILE.json", help="write the result JSON there")
    own = parser.add_argument_group("deployment started by the soak (without --base-url)")
    own.add_argument("--model", help="the served model (default: the embedded default model)")
    own.add_argument("--pd", help="a PD deployment, e.g. 1p1d (default: one instance)")
    own.add_argument("--server-args", default="", help='extra `splitserve serve` flags, e.g. "--max-num-seqs 32"')
    running = parser.add_argument_group("a running deployment")
    running.add_argument("--base-url", help="its root URL, e.g. http://127.0.0.1:8000")
    running.add_argument("--pid", type=int, help="its root process: the server, or the PD launcher")


def check_arguments(ns: argparse.Namespace) -> None:
    if (ns.base_url is None) != (ns.pid is None):
        raise ValueError(
            "--base-url and --pid go together: the soak samples the memory of the process --pid and below."
        )
    if ns.base_url and (ns.pd or ns.model or ns.server_args):
        raise ValueError("--pd, --model and --server-args start a deployment; they do not apply with --base-url.")
    if ns.concurrency < 1 or ns.duration <= 0 or ns.sample_interval <= 0:
        raise ValueError("--concurrency, --duration and --sample-interval must be positive.")
    if not 0 <= ns.abort_fraction + ns.error_fraction <= 1 or min(ns.abort_fraction, ns.error_fraction) < 0:
        raise ValueError("--abort-fraction and --error-fraction must be >= 0 and add up to at most 1.")
    if ns.kill_engine_every is not None and ns.kill_engine_every <= 0:
        raise ValueError("--kill-engine-every must be positive.")
    if ns.switch_roles_every is not None and (ns.switch_roles_every <= 0 or not (ns.pd or ns.base_url)):
        raise ValueError("--switch-roles-every needs a PD deployment (--pd, or a router's --base-url) and seconds > 0.")
    if ns.warmup >= ns.duration:
        raise ValueError(f"--warmup ({ns.warmup:g} s) must be shorter than --duration ({ns.duration:g} s).")


def _start(ns: argparse.Namespace) -> LocalInstance:
    flags = ["--disable-log-requests", *shlex.split(ns.server_args)]
    flags += ["--model", ns.model] if ns.model else []
    flags += ["--pd", ns.pd] if ns.pd else []
    deployment = start_instance("router" if ns.pd else "server", flags)
    wait_healthy([deployment])
    return deployment


def _instances(base_url: str) -> list[str]:
    """The URLs whose metrics say whether KV blocks are still in use: the instances behind a PD
    router, or the server itself."""
    behind = probe.router_instances(base_url)
    return [url for url, _ in behind] if behind else [base_url]


def sample_memory(root: int, started: float, instances: list[str]) -> dict:
    """One RSS sample of every process under `root`, with the part of the instances' KV caches
    used so far (resident because used, not leaked: a CPU cache is mapped lazily)."""
    processes = {}
    for pid in probe.process_tree(root):
        rss = probe.rss_bytes(pid)
        if rss is not None:
            processes[str(pid)] = {"name": probe.describe(pid), "rss_bytes": rss}
    total = sum(p["rss_bytes"] for p in processes.values())
    kv = sum(probe.kv_resident_bytes(url) for url in instances)
    sample = {"t_s": round(time.monotonic() - started, 1), "total_rss_bytes": total, "kv_touched_bytes": kv}
    return sample | {"processes": processes}


async def _sampler(
    root: int, started: float, instances: list[str], interval: float, samples: list, stop: asyncio.Event
) -> None:
    """A sample every `interval` seconds, and one more when the traffic stops."""
    while True:
        samples.append(await asyncio.to_thread(sample_memory, root, started, instances))
        mb, kv = samples[-1]["total_rss_bytes"] / 2**20, samples[-1]["kv_touched_bytes"] / 2**20
        print(
            f"[soak] t={samples[-1]['t_s']:7.0f} s  RSS of the deployment {mb:9.1f} MB (KV cache used {kv:.1f} MB)",
            flush=True,
        )
        if stop.is_set():
            return
        await probe.stopped_within(stop, interval)


async def _killer(
    root: int, deadline: float, every: float, rng: random.Random, kills: list, stop: asyncio.Event
) -> None:
    """kill -9 of a random engine process under `root` every `every` seconds, each one noted, while
    the traffic has min(every, 30) seconds left to show the recovery."""
    started = time.monotonic()
    while not await probe.stopped_within(stop, every):
        if deadline - time.monotonic() < min(every, 30.0):
            return
        engines = probe.engine_processes(root)
        if not engines:
            print("[soak] no engine process to kill (all restarting)", flush=True)
            continue
        pid = rng.choice(engines)
        owner = probe.describe(probe.parent_of(pid) or pid)
        os.kill(pid, signal.SIGKILL)
        kills.append({"t_s": round(time.monotonic() - started, 1), "at": time.monotonic(), "pid": pid, "of": owner})
        print(f"[soak] t={kills[-1]['t_s']:7.0f} s  kill -9 of engine {pid} ({owner})", flush=True)


async def _drive(
    ns: argparse.Namespace, base_url: str, root: int, started: float, instances: list[str]
) -> tuple[Counter, list[dict], list[tuple], list[dict], list[dict]]:
    """The client streams until the deadline, with the RSS sampler (and the engine killer, the role
    switcher) beside them."""
    import aiohttp

    counts, samples, timeline, kills, switches, stop = Counter(), [], [], [], [], asyncio.Event()
    deadline = started + ns.duration
    sampler = asyncio.create_task(_sampler(root, started, instances, ns.sample_interval, samples, stop))
    killer = None
    if ns.kill_engine_every:
        rng = random.Random(ns.seed)
        killer = asyncio.create_task(_killer(root, deadline, ns.kill_engine_every, rng, kills, stop))
    helpers = [killer] if killer is not None else []
    if ns.switch_roles_every:
        rng = random.Random(ns.seed + 1)
        every = ns.switch_roles_every
        helpers.append(asyncio.create_task(soak_roles.switcher(base_url, deadline, every, rng, switches, stop)))
    connector = aiohttp.TCPConnector(limit=ns.concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        rngs = [random.Random(ns.seed * 1000 + i) for i in range(ns.concurrency)]
        await asyncio.gather(*(run_stream(session, base_url, ns, rng, deadline, counts, timeline) for rng in rngs))
    stop.set()
    await sampler
    await asyncio.gather(*helpers)
    return counts, samples, timeline, kills, switches


def recoveries(kills: list[dict], timeline: list[tuple]) -> list[dict]:
    """Per kill: seconds from the kill until the first request begun after it completed (None: none did)."""
    out = []
    for kill in kills:
        done = [(end, start) for start, end, outcome in timeline if outcome == "completed" and start >= kill["at"]]
        first = min(done) if done else None
        out.append(
            {k: v for k, v in kill.items() if k != "at"}
            | {
                "served_again_after_s": round(first[0] - kill["at"], 2) if first else None,
                "that_request_began_after_s": round(first[1] - kill["at"], 2) if first else None,
            }
        )
    return out


def leftovers(pids: set[int], timeout: float = 30.0) -> list[int]:
    """The processes of `pids` still alive `timeout` seconds after the deployment was stopped."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if probe.rss_bytes(pid) is not None]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def wait_idle(urls: list[str], timeout: float) -> dict[str, dict]:
    """Each instance's idle gauges once all are 0, or as they stand when `timeout` runs out."""
    deadline = time.monotonic() + timeout
    while True:
        loads = {url: probe.instance_load(url) for url in urls}
        if all(probe.is_idle(load) for load in loads.values()) or time.monotonic() > deadline:
            return loads
        time.sleep(1.0)


def main(ns: argparse.Namespace) -> dict:
    check_arguments(ns)
    deployment = None if ns.base_url else _start(ns)
    seen: set[int] = set()
    try:
        base_url = (ns.base_url or deployment.url).rstrip("/")
        root, started, instances = ns.pid or deployment.process.pid, time.monotonic(), _instances(base_url)
        counts, samples, timeline, kills, switches = asyncio.run(_drive(ns, base_url, root, started, instances))
        if kills:  # the last restart settles before the deployment is judged idle
            probe.wait_health(base_url, ns.idle_timeout)
        idle = wait_idle(instances, ns.idle_timeout)
        idle_sample = sample_memory(root, started, instances)
        seen = {int(pid) for sample in [*samples, idle_sample] for pid in sample["processes"]}
    finally:
        if deployment is not None:
            seen |= set(probe.process_tree(deployment.process.pid))
            deployment.stop(timeout=60)
    memory = memory_growth(samples, ns.warmup)
    result = {
        "duration_s": ns.duration,
        "concurrency": ns.concurrency,
        "base_url": base_url,
        "requests": dict(counts),
        "memory": memory,
        "idle": idle,
        "samples": samples,
        "idle_sample": idle_sample,
    }
    if kills:
        result["kills"] = recoveries(kills, timeline)
    if ns.switch_roles_every:
        result["role_switches"] = switches
    if deployment is not None:
        result["leftovers"] = leftovers(seen)
    result["problems"] = problems_of(counts, memory, idle, result)
    result["passed"] = not result["problems"]
    print_report(result)
    if ns.save_result:
        with open(ns.save_result, "w") as f:
            json.dump(result, f, indent=2)
        print(f"Result written to {ns.save_result}")
    return result
