"""The EngineCore's loop bodies over a fake executor: overlap (async) scheduling launches step
N+1 before it collects step N, waits for step N where sampling reads the output history, drops the
token of a step launched for a request that has just stopped, and gives the same outputs as the
plain loop. The fake samples a token that depends only on the request and its position, so
both loops must produce exactly the same sequences."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from splitserve.engine.core.engine_core import EngineCore
from splitserve.engine.messages import EngineCoreRequest
from splitserve.executor.step_input import ModelRunnerOutput, StepInput
from splitserve.sampling_params import SamplingParams

VOCAB = 50
EOS = 1


def token_at(request_id: str, position: int) -> int:
    """The token a request samples for `position`: fixed, whatever the batch or the loop."""
    return (sum(map(ord, request_id)) * 7 + position * 3) % (VOCAB - 2) + 2


@dataclass
class FakeStep:
    request_ids: list[str]
    sampled: dict[str, int]


class FakeExecutor:
    """Stands in for the Executor: no model, a log of launches and collects."""

    def __init__(self, num_blocks: int = 64):
        self.num_blocks = num_blocks
        self.log: list[tuple[str, tuple[str, ...]]] = []
        self.known: set[str] = set()
        self.pending_inputs = 0
        self.resumed = 0
        self.last: FakeStep | None = None  # the most recent launch: where a pending input comes from

    def determine_num_blocks(self) -> int:
        return self.num_blocks

    def determine_num_cpu_blocks(self, nbytes: int | None = None) -> int:
        return 0

    def initialize_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0, num_offload_blocks: int = 0) -> None:
        pass

    def kv_cache_memory(self) -> tuple[int, int]:
        return self.num_blocks * 1024, 0

    def capture_cuda_graphs(self) -> None:
        pass

    def launch(self, step_input: StepInput) -> FakeStep:
        self.known -= set(step_input.finished_request_ids)
        self.known |= {r.request_id for r in step_input.new_requests}
        sampled = {}
        for row in step_input.scheduled:
            assert row.request_id in self.known, f"{row.request_id} scheduled before the runner learnt of it"
            self.resumed += row.resumed
            if row.last_token_pending:
                assert self.last is not None and row.request_id in self.last.request_ids
                self.pending_inputs += 1
            if row.samples:
                sampled[row.request_id] = token_at(row.request_id, row.num_computed_tokens + row.num_tokens)
        ids = tuple(r.request_id for r in step_input.scheduled)
        self.log.append(("launch", ids))
        self.last = FakeStep(list(sampled), sampled)
        return self.last

    def collect(self, step: FakeStep) -> ModelRunnerOutput:
        self.log.append(("collect", tuple(step.request_ids)))
        return ModelRunnerOutput(sampled=dict(step.sampled))


def make_core(overlap: bool, executor: FakeExecutor | None = None) -> EngineCore:
    model = ModelConfig("fake", "fake", None, torch.float32, max_model_len=64, load_format="dummy")
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64)
    config = EngineConfig(model, CacheConfig(block_size=4), scheduler, torch.device("cpu"), async_scheduling=overlap)
    core = EngineCore(config, executor or FakeExecutor())
    core.executor.log.clear()
    return core


def add(core: EngineCore, rid: str, prompt_len: int, **params) -> None:
    params.setdefault("max_tokens", 6)
    sp = SamplingParams(temperature=0, **params)
    first = 2 + sum(map(ord, rid)) % 20  # requests share no prompt blocks
    prompt = [first + i % (VOCAB - first) for i in range(prompt_len)]
    core.add_request(EngineCoreRequest(rid, prompt, sp, EOS, sp.max_tokens, 0.0))


def run(core: EngineCore) -> dict[str, tuple[list[int], str]]:
    tokens: dict[str, list[int]] = {}
    reasons = {}
    for _ in range(200):
        if not core.has_unfinished_requests():
            break
        for out in core.step_fn():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                reasons[out.request_id] = out.finish_reason
        core.scheduler.check_invariants()
    assert not core.has_unfinished_requests() and core.kv_manager.usage == 0.0
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}


def both(requests) -> tuple[EngineCore, EngineCore, dict]:
    cores = [make_core(False), make_core(True)]
    results = []
    for core in cores:
        for rid, prompt_len, params in requests:
            add(core, rid, prompt_len, **params)
        results.append(run(core))
    assert results[0] == results[1]
    return cores[0], cores[1], results[0]


def test_step_fn_is_chosen_once():
    assert make_core(False).step_fn.__name__ == "step"
    assert make_core(True).step_fn.__name__ == "step_with_overlap"


def test_plain_loop_collects_each_step_before_the_next():
    plain, _, _ = both([("a", 5, {}), ("b", 9, {})])
    kinds = [kind for kind, _ in plain.executor.log]
    assert kinds == ["launch", "collect"] * (len(kinds) // 2)
    assert plain.executor.pending_inputs == 0


def test_overlap_launches_the_next_step_before_collecting():
    _, overlap, _ = both([("a", 5, {}), ("b", 9, {})])
    kinds = [kind for kind, _ in overlap.executor.log]
    assert "launch" in kinds and kinds[kinds.index("launch") + 1] == "launch"
    assert overlap.executor.pending_inputs > 5


def test_history_reading_requests_wait_for_the_step_in_flight():
    """A penalty reads the output tokens on the host: its next step is launched only after the step
    that sampled its last token was collected, so its inputs are never pending."""
    _, overlap, results = both([("pen", 4, {"repetition_penalty": 1.2}), ("plain", 6, {})])
    log = overlap.executor.log
    for i, (kind, ids) in enumerate(log):
        if kind == "launch" and "pen" in ids:
            earlier = [entry for entry in log[:i] if "pen" in entry[1]]
            assert not earlier or earlier[-1][0] == "collect", log[: i + 1]
    assert set(results) == {"pen", "plain"}


def test_a_stop_token_drops_the_overlapped_step():
    """The request stops at a token that the overlapped step does not know yet; that step's extra
    token is dropped, so the outputs equal the plain loop's, and the stop is reported as such."""
    stop = token_at("s", 6)  # its second output token (the first samples position 5, after the prompt)
    _, _, results = both([("s", 5, {"stop_token_ids": [stop], "max_tokens": 10}), ("t", 3, {"max_tokens": 10})])
    assert results["s"] == ([token_at("s", 5), stop], "stop")
    assert results["t"][1] == "length" and len(results["t"][0]) == 10


def test_a_moot_step_in_flight_is_finished_at_once():
    """When the last request stops, the step launched after it carries nothing anyone will read:
    the engine finishes it in the same call instead of looking busy."""
    core = make_core(True)
    add(core, "x", 4, max_tokens=2)
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step_fn()
    assert [o.finish_reason for o in outputs] == [None, "length"]
    assert core._in_flight is None


@pytest.mark.parametrize("overlap", [False, True])
def test_preempted_requests_resume_with_their_blocks_starting_over(overlap):
    """A tiny pool forces preemptions; the runner is told that a resumed request's blocks start
    over, and the tokens are the same as without preemption."""
    roomy = make_core(overlap)
    tight = make_core(overlap, FakeExecutor(num_blocks=16))
    for core in (roomy, tight):
        for i in range(4):
            add(core, f"r{i}", 10 + i, max_tokens=12)
    assert run(roomy) == run(tight)
    assert tight.scheduler.num_preemptions > 0 and tight.executor.resumed > 0


def test_with_speculation_each_step_is_collected_before_the_next_is_scheduled():
    """Async scheduling with speculative decoding: the next step's drafts follow this step's tokens,
    so step N is collected before N+1 is scheduled and launched (N's outputs go out while N+1
    runs), never two launches in a row; the outputs are the plain loop's."""
    from types import SimpleNamespace

    from splitserve.spec_decode.config import SpeculativeConfig

    expected = both([("a", 5, {}), ("b", 9, {})])[2]
    core = make_core(True)
    core.speculator.config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    proposed = []
    core.speculator.proposer = SimpleNamespace(
        propose=lambda rid, tokens, room: proposed.append((rid, len(tokens))) or [], finish=lambda *args: None
    )
    add(core, "a", 5)
    add(core, "b", 9)
    pending = core.executor.pending_inputs  # the warm-up's
    assert run(core) == expected
    kinds = [kind for kind, _ in core.executor.log]
    assert kinds == ["launch", "collect"] * (len(kinds) // 2)
    assert proposed and core.executor.pending_inputs == pending  # every step's inputs were known at its launch
