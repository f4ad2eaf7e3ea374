"""`splitserve bench pd`: one mixed instance against a PD deployment, on one `bench serve` workload,
in one run. Each deployment is started, measured and stopped in turn (never both at once), so both
get the whole machine."""

from __future__ import annotations

import argparse
import copy
import shlex

from splitserve.benchmarks import serve
from splitserve.disagg.launch import LocalInstance, start_instance, wait_healthy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve.add_arguments(parser)
    parser.add_argument("--pd", default="1p1d", help="the PD deployment to compare with one mixed instance")
    parser.add_argument(
        "--server-args",
        default="",
        help='extra `splitserve serve` flags for both deployments, e.g. "--dtype bfloat16 --max-model-len 4096"',
    )


def _deployment(ns: argparse.Namespace, extra: list[str]) -> LocalInstance:
    flags = ["--disable-log-requests", *shlex.split(ns.server_args), *extra]
    if ns.model:
        flags += ["--model", ns.model]
    return start_instance("router" if extra else "mixed", flags)


def _measure(ns: argparse.Namespace, extra: list[str]) -> dict:
    deployment = _deployment(ns, extra)
    try:
        wait_healthy([deployment])
        run = copy.copy(ns)
        run.base_url, run.model = deployment.url, None
        return serve.main(run)
    finally:
        deployment.stop(timeout=30)


def main(ns: argparse.Namespace) -> dict:
    serve.check_arguments(ns)
    results = {"mixed": _measure(ns, []), ns.pd: _measure(ns, ["--pd", ns.pd])}
    print(
        f"\n{'deployment':<12}{'TTFT median':>13}{'TTFT p99':>11}{'ITL median':>12}{'ITL p99':>10}"
        f"{'out tok/s':>11}   (ms)"
    )
    for name, r in results.items():
        print(
            f"{name:<12}{r['median_ttft_ms']:>13.1f}{r.get('p99_ttft_ms', 0.0):>11.1f}{r['median_itl_ms']:>12.1f}"
            f"{r.get('p99_itl_ms', 0.0):>10.1f}{r['output_throughput']:>11.1f}"
        )
    return results
