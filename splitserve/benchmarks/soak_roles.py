"""`splitserve bench soak --switch-roles-every SECONDS`: PD roles switched live under the soak's traffic.

That often the soak asks the PD router (POST /router/pd_role) to move one instance, chosen at random,
to another role (prefill, decode, mixed), never leaving a phase without an instance to run it (a
mixed instance runs both). Per switch it reports the router's answer and the seconds until the
instance did work of its new role: KV blocks served (prefill), pulled (decode), either (mixed), read
from its /metrics. The soak's own checks still hold: no request may fail, every instance ends idle.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from splitserve.benchmarks import soak_probe as probe

PD_ROLES = ("prefill", "decode", "mixed")
TRAFFIC_TARGET_S = 5.0  # the switched instance gets work of its new role within this long
_WATCH_S = 30.0  # how long a switch's first work of the new role is waited for
_COUNTERS = {"prefill": ("blocks_sent",), "decode": ("blocks_received",), "mixed": ("blocks_sent", "blocks_received")}


def serves_both_phases(roles: dict[str, str]) -> bool:
    roles_now = set(roles.values())
    return bool(roles_now & {"prefill", "mixed"}) and bool(roles_now & {"decode", "mixed"})


def next_switch(roles: dict[str, str], rng: random.Random) -> tuple[str, str] | None:
    """(instance url, its new role) for a switch after which both phases still have an instance."""
    options = [
        (url, new)
        for url, role in sorted(roles.items())
        for new in PD_ROLES
        if new != role and serves_both_phases({**roles, url: new})
    ]
    return rng.choice(options) if options else None


def _kv_work(url: str, role: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(probe.metric_value(text, f"splitserve:kv_transfer_{name}_total") or 0.0 for name in _COUNTERS[role])


def switch_once(router_url: str, url: str, role: str) -> dict:
    """One switch through the router, and the seconds until the instance worked in its new role."""
    before = _kv_work(url, role)
    asked = time.monotonic()
    r = httpx.post(f"{router_url}/router/pd_role", json={"url": url, "pd_role": role}, timeout=60)
    record = {"url": url, "to": role, "status": r.status_code, "answer": r.text[:300], "new_role_work_after_s": None}
    if r.status_code != 200:
        return record
    record["epoch"] = r.json().get("epoch")
    while time.monotonic() - asked < _WATCH_S:
        if _kv_work(url, role) > before:
            record["new_role_work_after_s"] = round(time.monotonic() - asked, 2)
            break
        time.sleep(0.2)
    return record


async def switcher(
    router_url: str, deadline: float, every: float, rng: random.Random, switches: list, stop: asyncio.Event
) -> None:
    """A switch every `every` seconds while the traffic has time left to show the new role's work."""
    started = time.monotonic()
    while not await probe.stopped_within(stop, every):
        if deadline - time.monotonic() < _WATCH_S:
            return
        roles = dict(await asyncio.to_thread(probe.router_instances, router_url))
        choice = next_switch(roles, rng)
        if choice is None:
            print(f"[soak] no role switch keeps both phases served: {roles}", flush=True)
            continue
        url, role = choice
        t_s = round(time.monotonic() - started, 1)
        record = {"t_s": t_s, "from": roles[url]} | await asyncio.to_thread(switch_once, router_url, url, role)
        switches.append(record)
        after = record["new_role_work_after_s"]
        print(
            f"[soak] t={t_s:7.0f} s  {url}: {record['from']} -> {role} (HTTP {record['status']}), "
            + (f"{role} work {after:.2f} s later" if after is not None else f"no {role} work seen"),
            flush=True,
        )


def problems(switches: list[dict]) -> list[str]:
    out = [f"the switch at t={s['t_s']} s was refused: {s['answer']}" for s in switches if s["status"] != 200]
    out += [
        f"the switch at t={s['t_s']} s of {s['url']} to {s['to']}: "
        + (
            f"its first {s['to']} work came {s['new_role_work_after_s']} s later (target {TRAFFIC_TARGET_S:g} s)"
            if s["new_role_work_after_s"] is not None
            else f"no {s['to']} work within {_WATCH_S:g} s"
        )
        for s in switches
        if s["status"] == 200 and (s["new_role_work_after_s"] or _WATCH_S) > TRAFFIC_TARGET_S
    ]
    return out
