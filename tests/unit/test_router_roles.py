"""PD roles switched while serving: an instance's role state (engine/pd_role.py), and the router
following an instance that switched (at its health checks, at once on a 409, or through its own
POST /router/pd_role) and rebalancing by itself (--auto-roles), against fake instances (test_router.py's)."""
# ruff: noqa: F811 - the fixtures imported from test_router.py are the tests' arguments

from __future__ import annotations

import pytest
from aiohttp import web

from splitserve.config import KVTransferConfig
from splitserve.disagg.policies import InstanceLoad
from splitserve.engine.pd_role import PDRoleState, for_config
from splitserve.entrypoints.router import RouterConfig
from splitserve.entrypoints.router.config import DECODE, PREFILL
from splitserve.entrypoints.router.pool import UpstreamPool
from splitserve.entrypoints.router.roles import rebalance_choice
from tests.unit.test_router import COMPLETION, FakeInstance, cluster, fake_loop, wait_for  # noqa: F401 - fixtures


# --- an instance's role state ------------------------------------------------------------------------
def test_a_switch_bumps_the_epoch_and_decides_which_requests_are_taken():
    roles = PDRoleState("prefill", switchable=True)
    assert (roles.role, roles.epoch) == ("prefill", 0)
    assert roles.takes(do_remote_decode=True, do_remote_prefill=False) is None
    assert roles.takes(do_remote_decode=False, do_remote_prefill=True) == "decode"
    assert roles.switch("decode") == ("prefill", 1)
    assert roles.takes(do_remote_decode=True, do_remote_prefill=False) == "prefill"
    assert roles.takes(do_remote_decode=False, do_remote_prefill=True) is None
    assert roles.switch("decode") == ("decode", 1)  # the same role again: nothing changes
    assert roles.switch("mixed") == ("decode", 2)
    assert roles.takes(True, False) is None and roles.takes(False, True) is None  # mixed: both phases
    roles.switch("prefill")
    assert roles.takes(False, False) is None  # a whole request: any role runs it
    with pytest.raises(ValueError, match="must be one of"):
        roles.switch("encode")


def test_an_instance_started_mixed_cannot_take_a_pd_role():
    roles = for_config(None)
    assert (roles.role, roles.switchable) == ("mixed", False)
    assert roles.switch("mixed") == ("mixed", 0)
    with pytest.raises(ValueError, match="started with --pd-role mixed"):
        roles.switch("prefill")
    assert for_config(type("C", (), {"kv_transfer_config": KVTransferConfig("decode")})()).switchable


# --- the router following ----------------------------------------------------------------------------
class RoleFake(FakeInstance):
    """A fake instance that switches its role as a real one does: POST /pd_role, an epoch in its
    GET /pd_role answer, and a 409 for a request meant for the role it left."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pd_role, self.epoch = self.role, 0

    def extra_routes(self) -> list:
        return [web.post("/pd_role", self.switch)]

    def take(self, role: str) -> None:
        self.pd_role, self.role, self.epoch = role, role, self.epoch + 1

    async def switch(self, request: web.Request) -> web.Response:
        self.take((await request.json())["pd_role"])
        return web.json_response({"pd_role": self.role, "epoch": self.epoch})

    async def answer_role(self, request: web.Request) -> web.Response:
        return web.json_response({"pd_role": self.pd_role, "epoch": self.epoch})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        kv = (await request.json()).get("kv_transfer_params") or {}
        needed = "prefill" if kv.get("do_remote_decode") else "decode" if kv.get("do_remote_prefill") else None
        if self.role == "mixed" and needed == PREFILL:  # mixed takes both phases: it answers as a prefill one
            self.role = PREFILL
            try:
                return await super().generate(request)
            finally:
                self.role = "mixed"
        if needed is not None and needed != self.role and self.role != "mixed":
            self.count += 1
            error = {"message": f"now a {self.role} instance", "type": "pd_role_changed", "param": None, "code": 409}
            return web.json_response({"error": error}, status=409)
        return await super().generate(request)


def urls(server, role: str) -> list[str]:
    return [i.url for i in server.router.instances[role]]


def test_the_router_follows_a_switch_at_its_next_health_check(cluster):
    server, [p0, p1], [d0], log = cluster(2, 1, fake=RoleFake, health_interval=0.2)
    p1.take(DECODE)
    wait_for(lambda: p1.url in urls(server, DECODE), what="the router to list p1 as a decode instance")
    assert urls(server, PREFILL) == [p0.url] and all(i.healthy for i in server.router.all_instances())
    for _ in range(4):
        assert server.client.post("/v1/completions", json=COMPLETION).status_code == 200
    assert {name for role, name in log if role == DECODE} == {"d0", "p1"}  # both decode now
    assert ("prefill", "p1") not in log[-8:] and p0.count == 4


def test_a_409_moves_the_instance_at_once_and_the_request_goes_elsewhere(cluster):
    server, [p0, p1], [d0], log = cluster(2, 1, fake=RoleFake)  # no periodic health check
    p0.take(DECODE)
    p1.take(DECODE)  # no prefill instance left: the request is decoded without remote prefill
    r = server.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200, r.text
    assert sorted(urls(server, DECODE)) == sorted([d0.url, p0.url, p1.url]) and urls(server, PREFILL) == []
    assert all(i.healthy for i in server.router.all_instances())  # a switch is no failure


def test_switching_through_the_router(cluster):
    server, [p0], [d0, d1], _ = cluster(1, 2, fake=RoleFake)
    r = server.client.post("/router/pd_role", json={"url": d1.url, "pd_role": "prefill"})
    assert r.status_code == 200 and r.json() == {"pd_role": "prefill", "epoch": 1}
    assert d1.role == PREFILL and urls(server, PREFILL) == [p0.url, d1.url]  # followed at once
    r = server.client.post("/router/pd_role", json={"url": d1.url, "pd_role": "mixed"})
    assert r.status_code == 200 and d1.url in urls(server, "mixed")
    assert server.client.post("/v1/completions", json=COMPLETION).status_code == 200
    r = server.client.post("/router/pd_role", json={"url": "http://nowhere:1", "pd_role": "decode"})
    assert r.status_code == 404 and p0.url in r.json()["error"]["message"]
    r = server.client.post("/router/pd_role", json={"url": p0.url, "pd_role": "encode"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "pd_role"


def test_a_mixed_instance_decodes_what_it_prefilled_without_pulling_from_itself(cluster):
    server, [p0], [d0], log = cluster(1, 1, fake=RoleFake)
    for inst, role in ((p0, "mixed"), (d0, PREFILL)):
        assert server.client.post("/router/pd_role", json={"url": inst.url, "pd_role": role}).status_code == 200
    for _ in range(4):  # prefill alternates between d0 and the mixed p0; p0 decodes every one
        r = server.client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 200, r.text
    assert [name for role, name in log] == ["d0", "p0", "p0", "p0", "d0", "p0", "p0", "p0"]
    kv = [body.get("kv_transfer_params") or {} for _, body in p0.bodies]
    prefills = [k for k in kv if k.get("do_remote_decode")]
    pulled = [k for k in kv if k.get("do_remote_prefill")]
    whole = [k for k in kv if not k]
    assert len(prefills) == 2 and len(whole) == 2  # what p0 prefilled it ran whole, from its prefix cache
    assert len(pulled) == 2 and all(k["remote_request_id"].startswith("d0-") for k in pulled)  # d0's: pulled
    # the leases of p0's own prefills are handed back at once, not left to expire
    assert sorted(k["remote_request_id"] for k in p0.released) == sorted(f"p0-{i}" for i in (2, 5)), p0.released


# --- --auto-roles --------------------------------------------------------------------------------------
def _pool(prefill_loads: list[float], decode_loads: list[float]) -> UpstreamPool:
    pool = UpstreamPool(
        RouterConfig([f"http://p{i}:1" for i in range(len(prefill_loads))], [f"http://d{i}:1" for i in range(3)])
    )
    pool.instances[DECODE] = pool.instances[DECODE][: len(decode_loads)]
    for inst, load in zip(pool.all_instances(), prefill_loads + decode_loads):
        inst.load = InstanceLoad(load, 0.0)
    return pool


@pytest.mark.parametrize(
    ("prefill", "decode", "move"),
    [
        ([9, 7], [1, 0], ("http://d1:1", PREFILL)),  # prefill carries 8 per instance, decode 0.5
        ([0, 1], [12, 8], ("http://p0:1", DECODE)),
        ([4, 4], [2, 2], None),  # within AUTO_ROLES_RATIO
        ([2, 1], [0, 0], None),  # a gap under AUTO_ROLES_MIN_GAP
        ([9, 9], [0], None),  # the lighter role keeps its one instance
    ],
)
def test_auto_roles_moves_the_least_loaded_instance_of_the_lighter_role(prefill, decode, move):
    choice = rebalance_choice(_pool(prefill, decode))
    assert (None if choice is None else (choice[0].url, choice[1])) == move


def test_auto_roles_needs_a_pd_pool():
    with pytest.raises(ValueError, match="--auto-roles"):
        RouterConfig(mixed_urls=["http://m:1"], auto_roles=True)


# --- bench soak --switch-roles-every -------------------------------------------------------------------
def test_the_soak_switches_roles_only_where_both_phases_stay_served():
    import random

    from splitserve.benchmarks.soak_roles import next_switch, problems

    rng = random.Random(0)
    for _ in range(50):  # 1P1D: either instance may go mixed, neither may take the other's role
        url, role = next_switch({"p": "prefill", "d": "decode"}, rng)
        assert role == "mixed"
    assert {next_switch({"p": "prefill", "d": "decode", "m": "mixed"}, rng) for _ in range(200)} >= {
        ("p", "decode"),
        ("d", "prefill"),
    }
    assert next_switch({"m": "mixed"}, rng) is None  # a lone mixed instance must keep both phases
    assert next_switch({"p": "prefill"}, rng) == ("p", "mixed")
    ok = {"t_s": 30, "url": "p", "to": "mixed", "status": 200, "answer": "", "new_role_work_after_s": 1.2}
    assert problems([ok]) == []
    late, refused = ok | {"new_role_work_after_s": 7.0}, ok | {"status": 400, "answer": "started mixed"}
    assert len(problems([late, refused, ok | {"new_role_work_after_s": None}])) == 3


def test_auto_roles_switches_an_instance_through_its_api(cluster):
    server, [p0], [d0, d1], _ = cluster(
        1, 2, fake=RoleFake, health_interval=0.1, auto_roles=True, auto_roles_interval=0.1
    )
    p0.load = (4, 6, 0.5)  # 10 requests on the one prefill instance, none on the decode ones
    wait_for(lambda: len(urls(server, PREFILL)) == 2, timeout=10, what="--auto-roles to add a prefill instance")
    moved = d0 if d0.role == PREFILL else d1
    assert moved.epoch == 1 and moved.url in urls(server, PREFILL) and len(urls(server, DECODE)) == 1


def test_the_router_reads_how_much_kv_each_instance_moves():
    """The dashboard's KV transfer rate per instance: the bytes an instance served plus pulled, from the
    /metrics the health check reads."""
    from splitserve.disagg.policies import parse_instance_load

    text = "\n".join(
        [
            "# TYPE splitserve:num_requests_running gauge",
            "splitserve:num_requests_running 2",
            "# TYPE splitserve:kv_transfer_bytes_sent counter",
            "splitserve:kv_transfer_bytes_sent_total 1000",
            "# TYPE splitserve:kv_transfer_bytes_received counter",
            "splitserve:kv_transfer_bytes_received_total 234",
        ]
    )
    load = parse_instance_load(text + "\n")
    assert (load.num_requests, load.kv_transfer_bytes) == (2, 1234)
