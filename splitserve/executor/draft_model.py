"""Speculative decoding with a draft model: a smaller model sharing the target's vocabulary proposes
each request's next drafts, greedily, beside the target in the model runner.

The draft has a paged KV cache of its own with the target's block ids, so that a request's block
table addresses both (the scheduler reserves num_speculative_tokens lookahead slots past each step
for the drafts' own KV). It keeps each request's tokens by position, from the steps' inputs and
the verified outputs, and how far its KV is valid; a request it has not seen, or one back from a
preemption, is caught up from position 0 (a prefix-cache hit or a PD pull gives the target's KV,
not the draft's). After the target's step is collected, for every request that sampled:

1. one pass over its tokens from where the draft's KV ends to its newest token (the token the
   target sampled after the accepted drafts), whose last logits give the first draft;
2. num_speculative_tokens - 1 passes of one token each give the others.

Drafts written past the verified tokens are overwritten when those positions are next computed.
"""

from __future__ import annotations

import logging

import torch

from splitserve.config import EngineConfig
from splitserve.executor.cpu_decode_stack import CPUDecodeStack
from splitserve.executor.host import to_device
from splitserve.executor.in_flight import InFlightStep
from splitserve.executor.input_batch import CachedRequestState, InputBatch
from splitserve.executor.kv_memory import kv_zeros
from splitserve.executor.step_input import ModelRunnerOutput, ScheduledRequest, StepInput
from splitserve.layers.rotary import is_dynamic_ntk
from splitserve.loader.weights import load_model

logger = logging.getLogger(__name__)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, device: torch.device, backend, rank, show_progress: bool):
        if rank.pp_size > 1:
            raise ValueError("A draft model (speculative decoding) does not run with pipeline parallelism.")
        self.config, self.device, self.backend, self.rank = config, device, backend, rank
        self.k = config.speculative_config.num_speculative_tokens
        self.disable_by_batch_size = config.speculative_config.disable_by_batch_size
        self.block_size = config.cache_config.block_size
        self.model = load_model(config.draft_model_config, device, show_progress)
        self.tokens: dict[str, list[int]] = {}  # per request, by position
        self.computed: dict[str, int] = {}  # per request: positions whose draft KV is valid
        self.decode_stack: CPUDecodeStack | None = None
        self.uses_rope_lengths = is_dynamic_ntk(config.draft_model_config.hf_config)
        logger.info("Speculative decoding: draft model %s", config.draft_model_config.model)

    def kv_bytes_per_block(self) -> int:
        layers = self.model.attention_layers()
        head, itemsize = layers[0], self.config.draft_model_config.dtype.itemsize
        return 2 * len(layers) * self.block_size * head.num_kv_heads * head.head_dim * itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        layers = self.model.attention_layers()
        shape = (2, layers[0].num_kv_heads, num_blocks, self.block_size, layers[0].head_dim)
        for layer in layers:
            layer.kv_cache = kv_zeros(shape, self.config.draft_model_config.dtype, self.device)
            layer.kv_scales = None
        if self.device.type == "cpu":
            self.decode_stack = CPUDecodeStack.build(self.model, self.backend, self.rank, False)

    # --- keeping up with the target -------------------------------------------------------------
    def observe(self, step: StepInput) -> None:
        """A launched step's inputs: the requests' tokens by position (drafts excluded)."""
        for rid in step.finished_request_ids:
            self.tokens.pop(rid, None)
            self.computed.pop(rid, None)
        for data in step.new_requests:
            self.tokens[data.request_id] = list(data.prompt_token_ids)
            self.computed[data.request_id] = 0
        for row in step.scheduled:
            if row.resumed:
                self.computed[row.request_id] = 0
            real = row.token_ids[: len(row.token_ids) - row.num_draft_tokens]
            tokens = self.tokens[row.request_id]
            del tokens[row.num_computed_tokens :]
            tokens.extend(real)
            # A pending input (overlap scheduling) is not known yet: catch up from before it.
            known = row.num_computed_tokens + len(real)
            self.computed[row.request_id] = min(self.computed[row.request_id], known)

    # --- proposing ------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: dict[str, CachedRequestState], step: InFlightStep, out: ModelRunnerOutput) -> None:
        """Record each sampling request's verified tokens and put its next drafts in out.draft_token_ids."""
        rows = []
        for rid, token in out.sampled.items():
            first, drafts = step.drafts.get(rid, (0, []))
            tokens = self.tokens[rid]
            tokens.extend(drafts[: out.num_accepted.get(rid, 0)] + [token])
            room = self._room(requests[rid], len(tokens))
            if room > 0:
                rows.append((requests[rid], room))
        if not rows or (self.disable_by_batch_size is not None and len(out.sampled) >= self.disable_by_batch_size):
            return
        proposals = self._catch_up([state for state, _ in rows])
        for i in range(1, self.k):
            going = [(state, proposals[state.request_id]) for state, room in rows if room > i]
            if not going:
                break
            for state, token in zip([s for s, _ in going], self._decode(going)):
                proposals[state.request_id].append(token)
        for state, room in rows:
            out.draft_token_ids[state.request_id] = proposals[state.request_id][:room]

    def _room(self, state: CachedRequestState, num_tokens: int) -> int:
        """Drafts that can still become output (fewer near max_tokens or max_model_len)."""
        params = state.sampling_params
        outputs = num_tokens - state.num_prompt_tokens
        left = self.config.model_config.max_model_len - num_tokens
        if params.max_tokens is not None:
            left = min(left, params.max_tokens - outputs)
        return min(self.k, left - 1)

    def _catch_up(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        """Pass 1: each request's tokens from where its draft KV ends to its newest; the first drafts."""
        batch_rows = []
        for state in states:
            rid, tokens = state.request_id, self.tokens[state.request_id]
            start = self.computed[rid]
            batch_rows.append(
                (state, ScheduledRequest(rid, start, len(tokens) - start, tokens[start:], [], samples=True))
            )
            self.computed[rid] = len(tokens)
        batch = InputBatch.build(batch_rows, self.block_size)
        return {state.request_id: [token] for state, token in zip(batch.requests, self._forward_argmax(batch))}

    def _decode(self, going: list[tuple[CachedRequestState, list[int]]]) -> list[int]:
        """One draft token more for each request: its last draft at the next position."""
        batch_rows = []
        for state, proposed in going:
            position = len(self.tokens[state.request_id]) + len(proposed) - 1
            batch_rows.append((state, ScheduledRequest(state.request_id, position, 1, [proposed[-1]], [], True)))
        batch = InputBatch.build(batch_rows, self.block_size)  # (it orders its rows: map them back by id)
        tokens = {state.request_id: token for state, token in zip(batch.requests, self._forward_argmax(batch))}
        return [tokens[state.request_id] for state, _ in going]

    def _forward_argmax(self, batch: InputBatch) -> list[int]:
        dev = self.device
        meta = batch.attention_metadata(self.backend, dev, self.uses_rope_lengths)
        input_ids = to_device(batch.input_ids, torch.long, dev)
        positions = to_device(batch.positions, torch.long, dev)
        if self.decode_stack is not None and self.decode_stack.takes(meta, positions.shape[0]):
            hidden = self.decode_stack.forward(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta, None)
        last = to_device([batch.query_start_loc[i + 1] - 1 for i in range(len(batch.requests))], torch.long, dev)
        logits = self.model.compute_logits(hidden.index_select(0, last))
        return logits.argmax(dim=-1).tolist()
