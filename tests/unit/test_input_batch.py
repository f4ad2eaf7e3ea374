"""One step's host inputs (executor/input_batch.py): prompt rows and decode rows (which take a short
path) laid out as the forward and the attention backends read them."""

from __future__ import annotations

import torch

from splitserve.executor.input_batch import CachedRequestState, InputBatch
from splitserve.executor.step_input import ScheduledRequest
from splitserve.sampling_params import SamplingParams


def _state(rid: str, prompt_len: int, blocks: list[int]) -> CachedRequestState:
    state = CachedRequestState(rid, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=8), set())
    state.block_ids = blocks
    return state


def test_prompt_and_decode_rows():
    prompt = _state("p", 6, [7, 8])  # a prompt chunk: positions 2..5, the prompt ends, it samples
    decode = _state("d", 3, [4])  # a decode at position 3, its token known
    pending = _state("q", 2, [9, 5])  # a decode at position 5 whose token the step in flight samples
    rows = [
        (prompt, ScheduledRequest("p", 2, 4, [102, 103, 104, 105], [], samples=True)),
        (decode, ScheduledRequest("d", 3, 1, [42], [], samples=True)),
        (pending, ScheduledRequest("q", 5, 1, [], [], samples=True)),
    ]
    batch = InputBatch.build(rows, block_size=4)
    # Decodes first, in their order; then the prompt.
    assert [s.request_id for s in batch.sample_slots] == ["d", "q", "p"]
    assert batch.num_decodes == 2
    assert batch.input_ids == [42, 0, 102, 103, 104, 105]
    assert batch.pending_inputs == [(1, "q")]
    assert batch.positions == [3, 5, 2, 3, 4, 5]
    assert batch.slot_mapping == [4 * 4 + 3, 5 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 8 * 4 + 0, 8 * 4 + 1]
    assert batch.query_start_loc == [0, 1, 2, 6]
    assert batch.seq_lens == [4, 6, 6]
    assert batch.logits_indices == [0, 1, 5]
    assert [s.sample_index for s in batch.sample_slots] == [1, 4, 0]
    expected = torch.tensor([[4, 0], [9, 5], [7, 8]], dtype=torch.int32)
    assert torch.equal(batch.block_table_tensor(), expected)
