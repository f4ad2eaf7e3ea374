"""`splitserve ranktable gen|merge`: the command line of the rank-table files of a PD deployment
(splitserve/disagg/ranktable.py holds the format, its rules, and how tables are generated and merged)."""

from __future__ import annotations

import argparse
from pathlib import Path

from splitserve.disagg.ranktable import MERGED_FILE_NAME, load_ranktable, write_ranktable
from splitserve.disagg.ranktable_tools import (
    default_server_ip,
    generate_ranktables,
    merge_ranktables,
    parse_server_list,
)


def add_gen_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill-server-list",
        nargs="*",
        default=[],
        help="device ids of this machine's prefill instances: comma-separated within an instance, "
        "instances separated by spaces (e.g. '4,5 6,7' is two instances; ';' also separates); none: no prefill",
    )
    parser.add_argument("--decode-server-list", nargs="*", default=[], help="the same for the decode instances")
    parser.add_argument("--api-server", action="store_true", help="this machine also runs the router (group 0)")
    parser.add_argument("--save-dir", default=".", help="directory for the tables (created if missing; default: .)")
    parser.add_argument(
        "--server-ip",
        default=None,
        help="this machine's IP (default: its hostname's address, or 127.0.0.1 if that does not "
        "resolve; a loopback result is only usable on one machine)",
    )


def gen_main(ns: argparse.Namespace) -> list[Path]:
    """`splitserve ranktable gen`: write and print this machine's tables."""
    tables = generate_ranktables(
        ns.server_ip or default_server_ip(),
        parse_server_list(ns.prefill_server_list),
        parse_server_list(ns.decode_server_list),
        ns.api_server,
    )
    paths = [write_ranktable(table, Path(ns.save_dir) / name) for name, table in tables.items()]
    for path in paths:
        print(path)
    return paths


def add_merge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--global-ranktable-list",
        nargs="+",
        required=True,
        help="the machines' global_ranktable_<ip>.json files, in the order their instances take",
    )
    parser.add_argument(
        "--save-dir", default=".", help=f"directory for {MERGED_FILE_NAME} (created if missing; default: .)"
    )


def merge_main(ns: argparse.Namespace) -> Path:
    """`splitserve ranktable merge`: write and print global_ranktable_merge.json."""
    merged = merge_ranktables([load_ranktable(p) for p in ns.global_ranktable_list], source=MERGED_FILE_NAME)
    path = write_ranktable(merged, Path(ns.save_dir) / MERGED_FILE_NAME)
    print(path)
    return path
