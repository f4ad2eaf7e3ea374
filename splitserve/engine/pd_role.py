"""A PD instance's role as its API workers see it, changed while it serves (POST /pd_role).

Every instance started with a PD role (prefill or decode) runs both sides of the KV connector, so
the engine serves any role; the role decides which requests the front-end takes: a prefill request
(do_remote_decode) as a prefill or mixed instance, a decode request (do_remote_prefill) as a decode
or mixed instance, and whole requests in every role (a mixed instance takes all three kinds). A
switch bumps the epoch; a request meant for the old role is then refused with a 409 that names the
new role and epoch, and the router sends it elsewhere. What the instance already holds is finished
where it is: running requests complete, and a former prefill instance's KV server keeps serving its
leases until they are pulled, released or expire.

The role and epoch live in shared memory, so that every API worker of the instance (--workers) sees
a switch made through any of them. An instance started as mixed has no KV connector and cannot take
a PD role later: it is refused with the reason.
"""

from __future__ import annotations

import logging
import multiprocessing
import weakref

from splitserve.config import PD_ROLES, KVTransferConfig

logger = logging.getLogger(__name__)


class PDRoleState:
    """The role (one of PD_ROLES) and its epoch (0: the role the instance started with; +1 per switch)."""

    def __init__(self, role: str, switchable: bool):
        ctx = multiprocessing.get_context("spawn")  # one RawValue each: no lock, no semaphore to leak
        self._role = ctx.RawValue("q", PD_ROLES.index(role))
        self._epoch = ctx.RawValue("q", 0)
        self.switchable = switchable  # started with a PD role: it has both sides of the KV connector

    @property
    def role(self) -> str:
        return PD_ROLES[self._role.value]

    @property
    def epoch(self) -> int:
        return self._epoch.value

    def switch(self, role: str) -> tuple[str, int]:
        """Take `role` from now on: (the previous role, the new epoch). The same role again changes
        nothing (the epoch stays)."""
        if role not in PD_ROLES:
            raise ValueError(f"pd_role must be one of {', '.join(PD_ROLES)}; got {role!r}.")
        previous = self.role
        if role != previous and not self.switchable:
            raise ValueError(
                "This instance was started with --pd-role mixed and has no KV connector: only an instance "
                "started with --pd-role prefill or decode can change its role while it serves."
            )
        if role != previous:
            self._role.value = PD_ROLES.index(role)  # the role first: a reader of the new epoch sees it
            self._epoch.value += 1
            logger.info("PD role switched from %s to %s (epoch %d)", previous, role, self.epoch)
        return previous, self.epoch

    def takes(self, do_remote_decode: bool, do_remote_prefill: bool) -> str | None:
        """None when a request with these kv_transfer_params is this role's work, else the role it needs."""
        if self.role == "mixed":
            return None
        if do_remote_decode and self.role != "prefill":
            return "prefill"
        if do_remote_prefill and self.role != "decode":
            return "decode"
        return None


_LOCAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def role_state(engine, config) -> PDRoleState:
    """The instance's shared role state: the one its supervisor's EngineWatch carries to every API
    worker, or (a front-end without a supervisor: tests, tools) one per engine client."""
    watch = getattr(engine, "engine_watch", None)
    if watch is not None and getattr(watch, "pd_role", None) is not None:
        return watch.pd_role
    if engine not in _LOCAL:
        _LOCAL[engine] = for_config(config)
    return _LOCAL[engine]


def for_config(config) -> PDRoleState:
    """The role an instance starts with (no config: a plain, mixed one)."""
    kv = getattr(config, "kv_transfer_config", None) or KVTransferConfig()
    return PDRoleState(kv.pd_role, switchable=kv.is_disaggregated)
