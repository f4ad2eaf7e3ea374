"""The runner's persistent batch (executor/persistent_batch.py): rows kept between steps, block ids
and sampling parameters written in place, and decode steps gathered from them exactly as
InputBatch.build lays them out, their sampling metadata exactly as build_sampling_metadata makes it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from splitserve.executor.input_batch import CachedRequestState, InputBatch
from splitserve.executor.persistent_batch import PersistentBatch
from splitserve.executor.sampling_metadata import build_sampling_metadata
from splitserve.executor.step_input import ScheduledRequest
from splitserve.lora.request import LoRARequest
from splitserve.sampling_params import SamplingParams

BS = 4


def _same_batch(got: InputBatch, want: InputBatch) -> None:
    for name in (
        "input_ids",
        "positions",
        "slot_mapping",
        "query_start_loc",
        "seq_lens",
        "num_decodes",
        "logits_indices",
        "pending_inputs",
    ):
        assert getattr(got, name) == getattr(want, name), name
    assert [s.state for s in got.sample_slots] == [s.state for s in want.sample_slots]
    assert [s.sample_index for s in got.sample_slots] == [s.sample_index for s in want.sample_slots]
    assert [r.request_id for r in got.requests] == [r.request_id for r in want.requests]
    assert torch.equal(got.block_table_tensor(), want.block_table_tensor())


class Engine:
    """Plays the engine's side: requests with prompts, blocks handed out as they fill, then decodes."""

    def __init__(self, params_of=lambda i: SamplingParams(temperature=0)):
        self.batch = PersistentBatch(BS)
        self.states: dict[str, CachedRequestState] = {}
        self.lengths: dict[str, int] = {}  # tokens in the KV cache
        self.next_block = 1
        self.params_of = params_of

    def admit(self, count: int, prompt_len: int) -> list[tuple[CachedRequestState, ScheduledRequest]]:
        rows = []
        for _ in range(count):
            rid = f"r{len(self.states)}"
            state = CachedRequestState(rid, list(range(prompt_len)), self.params_of(len(self.states)), set())
            self.states[rid] = state
            self.batch.add(state)
            self.lengths[rid] = 0
            rows.append(self._row(state, prompt_len, list(range(prompt_len))))
        return rows

    def _row(self, state, n: int, tokens: list[int], resumed: bool = False) -> tuple:
        start = self.lengths[state.request_id]
        have = 0 if resumed else len(state.block_ids)
        need = -(-(start + n) // BS) - have
        new = list(range(self.next_block, self.next_block + max(need, 0)))
        self.next_block += len(new)
        row = ScheduledRequest(state.request_id, start, n, tokens, new, samples=True, resumed=resumed)
        state.update(row)
        self.batch.update_blocks(state, row)
        self.lengths[state.request_id] = start + n
        return state, row

    def decode(self, pending: set[str] = frozenset()) -> list[tuple]:
        return [self._row(s, 1, [] if rid in pending else [7 + len(self.states)]) for rid, s in self.states.items()]

    def finish(self, rid: str) -> None:
        self.batch.remove(self.states.pop(rid))


def test_decode_steps_gather_what_build_lays_out():
    engine = Engine()
    prompts = engine.admit(5, prompt_len=6)
    assert not engine.batch.takes(prompts)  # prompt rows: InputBatch.build's
    for step in range(12):  # blocks fill and new ones arrive every 4 steps
        rows = engine.decode(pending={"r1", "r3"} if step % 2 else set())
        assert engine.batch.takes(rows)
        _same_batch(engine.batch.decode_step(rows), InputBatch.build(rows, BS))
        if step == 5:
            engine.finish("r2")  # its row is freed and taken by the next request
            (admitted,) = engine.admit(1, prompt_len=3)
            assert admitted[0].row == 2
    # a request preempted and resumed gets its block list anew
    state = engine.states["r0"]
    engine.lengths["r0"] = 0
    _, row = engine._row(state, len(state.prompt_token_ids) + 3, list(range(9)), resumed=True)
    assert engine.batch.num_blocks[state.row] == len(state.block_ids) == 3
    assert engine.batch.block_table[state.row, :3].tolist() == state.block_ids
    rows = engine.decode()
    _same_batch(engine.batch.decode_step(rows), InputBatch.build(rows, BS))


def test_the_columns_grow_past_their_first_size():
    engine = Engine()
    engine.admit(70, prompt_len=70)  # more rows than 64, more blocks than 16 per row
    rows = engine.decode()
    assert engine.batch.block_table.shape[0] >= 70 and engine.batch.block_table.shape[1] >= 18
    _same_batch(engine.batch.decode_step(rows), InputBatch.build(rows, BS))


def test_rows_that_build_lays_out_differently_are_left_to_it():
    engine = Engine()
    engine.admit(2, prompt_len=5)
    rows = engine.decode()
    state, row = rows[0]
    drafts = ScheduledRequest(row.request_id, row.num_computed_tokens, 3, [1, 2, 3], [], True, num_draft_tokens=2)
    assert not engine.batch.takes([(state, drafts), rows[1]])
    state.lora_request = LoRARequest("a", 1, "/nowhere")
    assert not engine.batch.takes(rows)


@pytest.mark.parametrize("seed", range(4))
def test_sampling_metadata_is_what_build_sampling_metadata_makes(seed):
    rng = random.Random(seed)

    def params(i: int) -> SamplingParams:
        return SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.0]),
            top_k=rng.choice([0, 0, 5]),
            top_p=rng.choice([1.0, 1.0, 0.9]),
            min_p=rng.choice([0.0, 0.0, 0.1]),
            logprobs=rng.choice([None, None, 2]),
        )

    engine = Engine(params)
    engine.admit(9, prompt_len=3)
    rows = engine.decode()
    batch = engine.batch.decode_step(rows)
    got = engine.batch.sampling_metadata(batch, 50, torch.device("cpu"))
    want = build_sampling_metadata(batch.sample_slots, 50, torch.device("cpu"))
    assert got.all_greedy == want.all_greedy and got.max_num_logprobs == want.max_num_logprobs
    for name in ("temperature", "top_k", "top_p", "min_p"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.seeds == {} and got.logit_bias is None and got.output_counts is None


@pytest.mark.parametrize(
    "special",
    [
        {"seed": 3},
        {"repetition_penalty": 1.2},
        {"presence_penalty": 0.5},
        {"logit_bias": {3: 1.0}},
        {"min_tokens": 2},
        {"bad_words": ["x"]},
    ],
)
def test_rows_with_per_step_sampling_data_leave_it_to_build_sampling_metadata(special):
    if "bad_words" in special:
        params = SamplingParams()
        params.bad_words_token_ids = [[3]]
    else:
        params = SamplingParams(**special)
    engine = Engine(lambda i: params if i == 1 else SamplingParams())
    engine.admit(3, prompt_len=2)
    batch = engine.batch.decode_step(engine.decode())
    assert engine.batch.sampling_metadata(batch, 50, torch.device("cpu")) is None
    assert engine.batch.sampling_metadata(InputBatch.build(engine.decode(), BS), 50, torch.device("cpu")) is None
    assert np.array_equal(engine.batch.plain[[s.row for s in engine.states.values()]], [True, False, True])
