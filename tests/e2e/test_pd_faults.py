"""The PD kill matrix: kill -9 of the prefill instance, the decode instance or the router, each (a)
before the prefill answers, (b) during the KV pull, (c) during decode, with a streamed completion in
flight through the router.

Each stage is seen before the kill, not guessed with a sleep: the prefill instance runs with the KV
fault-injection variables (docs/pd.md), and its log says when a request's answer is being held back
(a) and when a pull's blocks are being sent (b); (c) is two streamed tokens at the client.

After each kill: the client gets a completed answer or a clear error (an OpenAI error body, or an
error event closing the stream, or, with the router dead, its connection closed), never a hang; and
the surviving instances hold no KV block, by their /metrics (the usage gauge and the count of the
engine's own invariant check), within the time the cell states. How long each side waits:

- the prefill instance frees unclaimed blocks when the router hands the lease back (the decode
  instance failed), or, with the router dead, when its server sees its client gone and aborts the
  request (the lease, LEASE_S, would expire later);
- a pull from a KV server that dies fails as soon as its connection drops (30 s without an answer
  from a live but silent one); the decode instance then computes the prompt itself;
- the router sees a dead instance at once (connection refused or closed) and gives up on the request
  (no other instance of that role here): a 503, or an error event if the stream had begun;
- a decode instance whose client (the router) is gone aborts the request at its next output, or as
  soon as its pull ends.

The killed process is started again (on its port) for the next cell: most of the module's time
(3 to 3.5 minutes on the project's 2-core machine while other work ran on it)
goes into those starts.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.helpers.pd import COMMON, idle, wait_for
from tests.helpers.server import RemoteServer, free_port

pytestmark = pytest.mark.slow  # starts PD deployments and kills their processes

LEASE_S = 30.0  # --kv-lease-seconds of the prefill instance: longer than _FREE_BOUND, so no cell waits for an expiry
LEASE_DELAY_S = 1.5  # the prefill instance holds each answer back this long after leasing the blocks
BLOCK_DELAY_S = 0.5  # and each pulled block this long (the prompts below pull 4 blocks)
CLIENT_TIMEOUT_S = 60.0  # the client's read timeout: no cell may come near it
ANSWER_WITHIN_S = 20.0  # every cell's client has its answer or error this soon after the kill
MAX_TOKENS = 64
ROLES = ("prefill", "decode", "router")
STAGE_MARKERS = {
    "before_prefill_answer": "Fault injection (SPLITSERVE_FAULT_KV_LEASE_DELAY_S)",
    "during_kv_pull": "Fault injection (SPLITSERVE_FAULT_KV_BLOCK_DELAY_S)",
}


class FaultCluster:
    """One prefill instance (with the fault-injection variables), one decode instance and a router,
    each on a fixed port so that a killed one is started again where the others expect it."""

    def __init__(self, model: str, logs: Path):
        self.model, self.logs = model, logs
        self.ports = {role: free_port() for role in ROLES}
        self.servers: dict[str, RemoteServer] = {}
        self.logs_of: dict[str, Path] = {}  # each role's log, of its latest start
        self.starts = 0
        self._starting: dict[str, threading.Thread] = {}  # starts under way

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def _start(self, role: str) -> None:
        log = str(self.logs_of[role])
        if role == "router":
            args, env = ["router", "--prefill", self.url("prefill"), "--decode", self.url("decode")], {}
            args += ["--health-interval", "0.5"]
            self.servers[role] = RemoteServer(None, *args, port=self.ports[role], log_path=log)
            return
        args = [*COMMON, "--pd-role", role]
        env = {}
        if role == "prefill":
            args += ["--kv-lease-seconds", str(LEASE_S)]
            env = {
                "SPLITSERVE_FAULT_KV_LEASE_DELAY_S": str(LEASE_DELAY_S),
                "SPLITSERVE_FAULT_KV_BLOCK_DELAY_S": str(BLOCK_DELAY_S),
            }
        self.servers[role] = RemoteServer(self.model, *args, env=env, port=self.ports[role], log_path=log)

    def start_missing(self) -> None:
        """Start whatever is neither running nor starting, each in a thread of its own, without waiting."""
        for role in ROLES:
            running = role in self.servers and self.servers[role].proc.poll() is None
            if running or role in self._starting:
                continue
            self.starts += 1
            self.logs_of[role] = self.logs / f"{role}-{self.starts}.log"
            self._starting[role] = threading.Thread(target=self._start, args=(role,))
            self._starting[role].start()

    def ensure_up(self) -> None:
        """Everything running, and the router seeing both instances up."""
        self.start_missing()
        for thread in self._starting.values():
            thread.join()
        self._starting.clear()
        assert all(self.servers[r].proc.poll() is None for r in ROLES), "a process did not start"
        wait_for(lambda: httpx.get(f"{self.url('router')}/health", timeout=5).status_code == 200, 30, "the router")

    def kill(self, role: str) -> None:
        """kill -9 of every process of the instance (or the router) at once."""
        server = self.servers[role]
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=10)

    def close(self) -> None:
        for thread in self._starting.values():  # a start under way would outlive the others' close
            thread.join()
        for server in self.servers.values():
            server.close()


@pytest.fixture(scope="module")
def cluster(tiny_chat_model, tmp_path_factory):
    cluster = FaultCluster(tiny_chat_model, tmp_path_factory.mktemp("pd_fault_logs"))
    yield cluster
    cluster.close()


@dataclass
class Outcome:
    """What the client saw of one streamed completion through the router."""

    status: int | None = None
    error_body: dict | None = None  # a non-200 answer's JSON
    events: list[str] = field(default_factory=list)  # the stream's data payloads, [DONE] included
    transport_error: str | None = None  # the connection broke (the router died)
    finished: threading.Event = field(default_factory=threading.Event)
    second_token: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        """Tokens streamed so far (a chunk may carry several: a decode instance's first token, from the
        prefill instance, goes out with the one it computes next)."""
        chunks = [json.loads(e) for e in self.events if e != "[DONE]"]
        return sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c.get("choices"))


def _stream(url: str, prompt: str, outcome: Outcome) -> None:
    start = time.monotonic()
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "logprobs": 0,
    }
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S) as r:
            outcome.status = r.status_code
            if r.status_code != 200:
                outcome.error_body = json.loads(r.read())
                return
            for line in r.iter_lines():
                if line.startswith("data: "):
                    outcome.events.append(line[6:])
                    if outcome.tokens == 2:
                        outcome.second_token.set()
    except httpx.TransportError as exc:
        outcome.transport_error = f"{type(exc).__name__}: {exc}"
    finally:
        outcome.seconds = time.monotonic() - start
        outcome.finished.set()


def _wait_for_stage(cluster: FaultCluster, stage: str, log_offset: int, outcome: Outcome) -> None:
    if stage == "during_decode":
        assert outcome.second_token.wait(60), "no two streamed tokens"
        return
    marker, log = STAGE_MARKERS[stage], cluster.logs_of["prefill"]
    wait_for(lambda: marker in log.read_text(errors="replace")[log_offset:], 60, f"the prefill log to say {marker}")


def _check_client(victim: str, stage: str, outcome: Outcome) -> str:
    """The client's outcome must be the cell's: returns it in words, for the summary line."""
    if victim == "prefill":  # the decode instance computes the prompt itself (or already had the KV)
        assert outcome.status == 200 and outcome.events[-1] == "[DONE]", outcome
        assert outcome.tokens == MAX_TOKENS and not any('"error"' in e for e in outcome.events)
        return f"completed ({outcome.tokens} tokens)"
    if victim == "router":
        assert outcome.transport_error is not None, outcome
        return f"connection closed ({outcome.transport_error})"
    if stage == "during_decode":  # the stream had begun: an error event, then [DONE]
        assert outcome.events[-1] == "[DONE]" and '"error"' in outcome.events[-2], outcome
        assert "failed mid-stream" in json.loads(outcome.events[-2])["error"]["message"]
        return f"error event after {outcome.tokens} tokens"
    assert outcome.status == 503, outcome
    message = outcome.error_body["error"]["message"]
    assert "decode instance" in message
    return f"503: {message}"


# The longest the survivors may take to free their blocks after the kill, in seconds: an abort, or
# the rest of a short completion on a loaded machine. No cell waits for a lease to expire: with the
# decode instance dead the router hands the prefill's lease back (POST /kv_transfer/release), and
# with the router dead the prefill instance's server sees its client gone and aborts the request,
# which ends its lease.
_FREE_BOUND = 15


@pytest.mark.parametrize("stage", ["before_prefill_answer", "during_kv_pull", "during_decode"])
@pytest.mark.parametrize("victim", ROLES)
def test_kill_matrix(cluster, victim, stage):
    cluster.ensure_up()
    log_offset = len(cluster.logs_of["prefill"].read_text(errors="replace"))
    outcome = Outcome()
    # A prompt of its own per cell, so that no prefix cache already holds its blocks: 4 are pulled.
    prompt = f"{victim} {stage}: " + "Once upon a time, in a land far away, there lived a dragon who " * 3
    client = threading.Thread(target=_stream, args=(cluster.url("router"), prompt, outcome), daemon=True)
    client.start()
    _wait_for_stage(cluster, stage, log_offset, outcome)
    killed_at, killed_at_unix = time.monotonic(), time.time()
    cluster.kill(victim)
    assert outcome.finished.wait(CLIENT_TIMEOUT_S), "the client hangs"
    answered = time.monotonic() - killed_at
    assert answered < ANSWER_WITHIN_S, f"the client waited {answered:.1f} s"
    what = _check_client(victim, stage, outcome)
    cluster.start_missing()  # the next cell's: it starts while the survivors are watched
    survivors = [role for role in ("prefill", "decode") if role != victim]
    freed = {role: _seconds_until_idle(cluster.url(role), (killed_at, killed_at_unix)) for role in survivors}
    print(
        f"\n[kill {victim} {stage}] client: {what}, {answered:.1f} s after the kill; blocks freed: "
        + ", ".join(f"{role} {s:.1f} s after the kill" for role, s in freed.items())
    )


def _seconds_until_idle(url: str, killed: tuple[float, float]) -> float:
    """Seconds from the kill (monotonic and Unix time) until the instance at `url` held no block, by
    stats taken after the kill; no more than _FREE_BOUND."""
    left = _FREE_BOUND - (time.monotonic() - killed[0])
    wait_for(lambda: idle(url, since=killed[1]), max(left, 1), f"{url} to free its blocks")
    return time.monotonic() - killed[0]
