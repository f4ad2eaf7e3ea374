"""The rope positions of a step for models with multimodal rope (Qwen2-VL's M-RoPE): a prompt's image
tokens have three positions each (time, height, width over the image's grid) and the tokens after
an image continue from the largest, so a request's rope positions are not its token indices.

The model computes each request's prompt positions once (`mrope_positions`, when the runner first
sees it) with the offset its later tokens keep (rope position = index + delta); a step gets [3, T]
positions when one of its tokens is an image token, else the one row they all equal, so that text
and decode steps run the plain rope paths (the CPU decode stack, CUDA graphs).
"""

from __future__ import annotations

import numpy as np

from splitserve.executor.input_batch import CachedRequestState, InputBatch


def remember_prompt_positions(model, state: CachedRequestState) -> None:
    """The request's prompt positions [3, L] and delta, from its images (none: its indices, delta 0)."""
    if state.mm_features:
        state.mrope_positions, state.mrope_delta = model.mrope_positions(state.num_prompt_tokens, state.mm_features)


def step_positions(batch: InputBatch) -> np.ndarray | None:
    """The step's rope positions, [3, T] or [T]; None when they are the token indices."""
    if all(state.mrope_positions is None for state in batch.requests):
        return None
    rows = [_row_positions(batch, i, state) for i, state in enumerate(batch.requests)]
    positions = np.concatenate(rows, axis=1)
    return positions[0] if (positions == positions[:1]).all() else positions


def _row_positions(batch: InputBatch, row: int, state: CachedRequestState) -> np.ndarray:
    index = np.asarray(batch.positions[batch.query_start_loc[row] : batch.query_start_loc[row + 1]])
    if state.mrope_positions is None:
        return np.broadcast_to(index, (3, len(index)))
    in_prompt = index < state.num_prompt_tokens
    out = np.empty((3, len(index)), dtype=np.int64)
    out[:, in_prompt] = state.mrope_positions[:, index[in_prompt]]
    out[:, ~in_prompt] = index[~in_prompt] + state.mrope_delta
    return out
