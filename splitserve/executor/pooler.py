"""Pooling on the model runner's device: a pooling request's prompt hidden states (after the
model's last norm) folded into one vector, chunk by chunk as the prompt is computed, then
finished (averaged, cut to `dimensions`, normalized) when its last chunk has run."""

from __future__ import annotations

import torch

from splitserve.executor.input_batch import PoolingSpan


def pool_step(hidden: torch.Tensor, spans: list[PoolingSpan], head=None) -> dict[str, torch.Tensor]:
    """Fold this step's rows into each pooling request's state; returns the finished embeddings
    (float32, on the device) by request id. A span that starts at position 0 starts the pooling
    over (a new prompt, or one computed again after a preemption). `head`: a classification
    model's head (pooled vector -> its logits), applied to each finished vector."""
    finished = {}
    for span in spans:
        state, params = span.state, span.state.pooling
        rows = hidden[span.first_index : span.first_index + span.count]
        if span.start == 0:
            state.pool = None
        kind = params.pooling_type
        if kind == "MEAN":
            total = rows.float().sum(0)
            state.pool = total if state.pool is None else state.pool + total
        elif kind == "CLS":
            if span.start == 0:
                state.pool = rows[0].float()
        else:  # LAST
            if span.last:
                state.pool = rows[-1].float()
        if span.last:
            vector = state.pool / (span.start + span.count) if kind == "MEAN" else state.pool
            if vector is None:
                raise RuntimeError(f"request {state.request_id}: its {kind} pooling saw no token to pool")
            if head is not None:
                vector = head(vector)
            if params.dimensions is not None:
                vector = vector[: params.dimensions]
            if params.normalize:
                vector = torch.nn.functional.normalize(vector, dim=-1)
            finished[state.request_id] = vector
            state.pool = None
    return finished
