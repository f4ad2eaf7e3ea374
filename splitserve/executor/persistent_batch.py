"""The runner's rows of live requests, kept between steps (vLLM's persistent input batch).

Each request the runner knows holds one row from the step it is first scheduled in until it is
forgotten; its block ids and its sampling parameters are numpy columns written in place: its
parameters once, its blocks when it gets new ones (a decode writes one block id each time its last
block fills). A step whose rows are all plain decodes (one generated token each, no drafts, no LoRA:
the common step of a busy server) is then gathered from the columns with a few array operations
(`decode_step`), and so is its sampling metadata where no row asks for per-step data
(`sampling_metadata`), instead of walking Python lists row by row. Other steps go through
InputBatch.build, which reads the same requests' block lists.
"""

from __future__ import annotations

import numpy as np
import torch

from splitserve.executor.host import move
from splitserve.executor.input_batch import CachedRequestState, InputBatch, SampleSlot
from splitserve.executor.sampler import GREEDY_TEMPERATURE, SamplingMetadata
from splitserve.executor.step_input import ScheduledRequest
from splitserve.sampling_params import SamplingParams

_INITIAL_ROWS, _INITIAL_BLOCKS = 64, 16


def _plain(params: SamplingParams) -> bool:
    """Sampling that reads nothing per step: no seed (keyed by the output index), no penalties, bias,
    allowed or banned tokens, min_tokens (which bans the stop tokens for a while)."""
    return (
        params.seed is None
        and params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and not params.logit_bias
        and params.allowed_token_ids is None
        and not params.bad_words_token_ids
        and not params.min_tokens
    )


class PersistentBatch:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.block_table = np.zeros((_INITIAL_ROWS, _INITIAL_BLOCKS), dtype=np.int32)
        self.num_blocks = np.zeros(_INITIAL_ROWS, dtype=np.int64)
        self.temperature = np.zeros(_INITIAL_ROWS, dtype=np.float32)
        self.top_k = np.zeros(_INITIAL_ROWS, dtype=np.int64)  # 0: no limit
        self.top_p = np.ones(_INITIAL_ROWS, dtype=np.float32)
        self.min_p = np.zeros(_INITIAL_ROWS, dtype=np.float32)
        self.num_logprobs = np.full(_INITIAL_ROWS, -1, dtype=np.int64)  # -1: none asked for
        self.plain = np.zeros(_INITIAL_ROWS, dtype=bool)
        self._free = list(range(_INITIAL_ROWS - 1, -1, -1))  # free rows, the lowest last (taken first)

    # --- rows -----------------------------------------------------------------------------------
    def add(self, state: CachedRequestState) -> None:
        """Give a new request a row, with its sampling parameters (its blocks come with its steps)."""
        if not self._free:
            self._grow_rows()
        row = state.row = self._free.pop()
        params = state.sampling_params
        self.num_blocks[row] = 0
        self.block_table[row] = 0  # a reused row: no ids of its last owner past the new one's blocks
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k or 0
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.plain[row] = _plain(params)

    def remove(self, state: CachedRequestState) -> None:
        if state.row >= 0:
            self._free.append(state.row)
            state.row = -1

    def update_blocks(self, state: CachedRequestState, row: ScheduledRequest) -> None:
        """Take a step's new block ids for the request (all of them after a preemption)."""
        start = 0 if row.resumed else int(self.num_blocks[state.row])
        end = start + len(row.new_block_ids)
        if end > self.block_table.shape[1]:
            self._grow_blocks(end)
        if row.new_block_ids:
            self.block_table[state.row, start:end] = row.new_block_ids
        if row.resumed:
            self.block_table[state.row, end:] = 0
        self.num_blocks[state.row] = end

    def _grow_rows(self) -> None:
        old = len(self.num_blocks)
        for name in ("block_table", "num_blocks", "temperature", "top_k", "top_p", "min_p", "num_logprobs", "plain"):
            column = getattr(self, name)
            grown = np.zeros((2 * old, *column.shape[1:]), dtype=column.dtype)
            grown[:old] = column
            setattr(self, name, grown)
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _grow_blocks(self, needed: int) -> None:
        width = max(needed, 2 * self.block_table.shape[1])
        grown = np.zeros((self.block_table.shape[0], width), dtype=np.int32)
        grown[:, : self.block_table.shape[1]] = self.block_table
        self.block_table = grown

    # --- a decode step --------------------------------------------------------------------------
    @staticmethod
    def takes(rows: list[tuple[CachedRequestState, ScheduledRequest]]) -> bool:
        """Whether every row is a plain decode: one generated token that samples, no drafts, no LoRA
        adapter, no pooling (what InputBatch.build would lay out one row per request, in order)."""
        return all(
            r.num_tokens == 1
            and r.samples
            and not r.num_draft_tokens
            and r.num_computed_tokens >= len(s.prompt_token_ids)
            and s.pooling is None
            and s.lora_request is None
            for s, r in rows
        )

    def decode_step(self, rows: list[tuple[CachedRequestState, ScheduledRequest]]) -> InputBatch:
        """The InputBatch that InputBatch.build makes of these rows (see takes()), gathered from the
        columns: positions, slots, lengths and the block table by array operations."""
        n = len(rows)
        states = [s for s, _ in rows]
        scheduled = [r for _, r in rows]
        bs = self.block_size
        index = np.fromiter((s.row for s in states), dtype=np.int64, count=n)
        positions = np.fromiter((r.num_computed_tokens for r in scheduled), dtype=np.int64, count=n)
        width = int(self.num_blocks[index].max()) if n else 0
        table = self.block_table[index, :width]
        batch = InputBatch(states, bs)
        batch.num_decodes = n
        batch.input_ids = [r.token_ids[0] if r.token_ids else 0 for r in scheduled]
        batch.pending_inputs = [(i, r.request_id) for i, r in enumerate(scheduled) if not r.token_ids]
        batch.positions = positions.tolist()
        batch.slot_mapping = (table[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs).tolist()
        batch.query_start_loc = list(range(n + 1))
        batch.seq_lens = (positions + 1).tolist()
        batch.table = torch.from_numpy(table)
        batch.rows = index
        batch.sample_slots = [SampleSlot(s, p + 1 - len(s.prompt_token_ids)) for s, p in zip(states, batch.positions)]
        batch.logits_indices = list(range(n))
        return batch

    # --- sampling -------------------------------------------------------------------------------
    def sampling_metadata(self, batch: InputBatch, vocab: int, device: torch.device) -> SamplingMetadata | None:
        """The sampler's inputs of a decode_step batch from the columns, or None when a row asks for
        per-step data (build_sampling_metadata then builds them). The same fields as it sets."""
        index = batch.rows
        if index is None or not self.plain[index].all():
            return None
        temperature = self.temperature[index]
        meta = SamplingMetadata(
            temperature=move(torch.from_numpy(temperature), device),
            all_greedy=bool((temperature < GREEDY_TEMPERATURE).all()),
        )
        top_k = self.top_k[index]
        if top_k.any():
            meta.top_k = move(torch.from_numpy(np.where(top_k > 0, top_k, vocab)), device)
        top_p = self.top_p[index]
        if (top_p < 1.0).any():
            meta.top_p = move(torch.from_numpy(top_p), device)
        min_p = self.min_p[index]
        if (min_p > 0.0).any():
            meta.min_p = move(torch.from_numpy(min_p), device)
        logprobs = self.num_logprobs[index]
        meta.max_num_logprobs = int(logprobs.max()) if (logprobs >= 0).any() else None
        return meta
