"""The model runner: owns the model, the paged KV cache tensors and the sampler, and turns one
SchedulerOutput into one forward pass plus sampling."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from splitserve import kernels
from splitserve.config import EngineConfig, cpu_kv_cache_bytes
from splitserve.engine.protocol import TokenLogprobs
from splitserve.engine.request import Request
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.executor.attention import AttentionMetadata, get_attention_backend
from splitserve.executor.sampler import Sampler, SamplerOutput, SamplingMetadata
from splitserve.loader.weights import load_model
from splitserve.quantization.kv_cache import SCALE_DTYPE, kv_cache_spec

logger = logging.getLogger(__name__)



@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Per request: logprobs of the prompt tokens this step scored (position p scores token p + 1).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass
class _Batch:
    """Host-side description of one step, built before anything touches the device."""

    requests: list[tuple[Request, int]]
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    num_decodes: int
    sample_rows: list[int]            # index into requests of those that sample a token
    logits_indices: list[int]         # the token whose logits each sampling request samples from
    prompt_logprob_spans: list[tuple[int, int, int]]  # (request index, first token, count)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.device
        self.block_size = config.cache_config.block_size
        torch.manual_seed(config.model_config.seed)
        if self.device.type == "cpu":
            kernels.enable_transparent_huge_pages()
        self.model = load_model(config.model_config, self.device, config.use_tqdm_on_load)
        self.backend = get_attention_backend(self.device, config.cache_config.cache_dtype)
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self.kv_spec = kv_cache_spec(config.cache_config.cache_dtype, config.model_config.dtype)
        self.kv_caches: list[torch.Tensor] = []
        self.kv_scales: list[torch.Tensor] | None = None  # per layer, with a quantized cache only

    # --- KV cache --------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        mc = self.config.model_config
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * self.kv_spec.bytes_per_vector(mc.head_dim)

    def determine_num_blocks(self) -> int:
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - cc.gpu_memory_utilization))
        else:
            budget = cpu_kv_cache_bytes()
        # More blocks than max_num_seqs full-length sequences can use is only wasted memory.
        sc = self.config.scheduler_config
        useful = sc.max_num_seqs * -(-sc.max_model_len // self.block_size)
        return min(budget // self.kv_bytes_per_block(), useful)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        mc, spec = self.config.model_config, self.kv_spec
        # Head-major: gathering a request's blocks gives [heads, tokens, head_dim] with no transposing copy.
        shape = (2, mc.num_kv_heads, num_blocks, self.block_size, spec.packed_head_dim(mc.head_dim))
        self.kv_caches = [torch.zeros(shape, dtype=spec.storage_dtype, device=self.device)
                          for _ in range(mc.num_layers)]
        if spec.quantized:
            # Each cached vector's scale fields, in the same layout: [2, heads, blocks, block_size, fields].
            self.kv_scales = [torch.zeros(*shape[:-1], spec.num_scale_fields, dtype=SCALE_DTYPE, device=self.device)
                              for _ in range(mc.num_layers)]
        for i, layer in enumerate(self.model.attention_layers()):
            layer.kv_cache = self.kv_caches[i]
            layer.kv_scales = self.kv_scales[i] if spec.quantized else None  # None: the unquantized path
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s)", num_blocks, self.block_size,
                    num_blocks * self.block_size, num_blocks * self.kv_bytes_per_block() / (1 << 30),
                    spec.describe())

    # --- requests ---------------------------------------------------------------------------
    def remove_requests(self, request_ids) -> None:
        for rid in request_ids:
            self.generators.pop(rid, None)

    def _generator(self, request: Request) -> torch.Generator:
        gen = self.generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(request.sampling_params.seed)
            self.generators[request.request_id] = gen
        return gen

    # --- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput, block_ids: dict[str, list[int]]) -> ModelRunnerOutput:
        batch = self._prepare(sched, block_ids)
        dev = self.device
        meta = AttentionMetadata(
            backend=self.backend,
            num_decodes=batch.num_decodes,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            seq_lens_tensor=torch.tensor(batch.seq_lens, dtype=torch.int32, device=dev),
            block_tables=_pad_2d(batch.block_tables, dev),
            slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.long, device=dev),
            block_size=self.block_size,
        )
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long, device=dev)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=dev)
        hidden = self.model(input_ids, positions, meta)
        out = ModelRunnerOutput()
        if batch.sample_rows:
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            requests = [batch.requests[i][0] for i in batch.sample_rows]
            sampled = self.sampler(logits, self._sampling_metadata(requests, logits.shape[-1]))
            self._collect_samples(requests, sampled, out)
        for row, first, count in batch.prompt_logprob_spans:
            request = batch.requests[row][0]
            out.prompt_logprobs[request.request_id] = self._prompt_logprobs(request, hidden, first, count, batch)
        return out

    def _prepare(self, sched: SchedulerOutput, block_ids: dict[str, list[int]]) -> _Batch:
        # Decodes (one query token) first, so attention can batch them in one call.
        ordered = sorted(sched.scheduled, key=lambda rn: rn[1] != 1)
        b = _Batch(ordered, [], [], [], [0], [], [], sum(1 for _, n in ordered if n == 1), [], [], [])
        bs = self.block_size
        for row, (request, n) in enumerate(ordered):
            start, blocks = request.num_computed_tokens, block_ids[request.request_id]
            end = start + n
            b.input_ids.extend(request.all_token_ids[start:end])
            b.positions.extend(range(start, end))
            b.slot_mapping.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            b.query_start_loc.append(b.query_start_loc[-1] + n)
            b.seq_lens.append(end)
            b.block_tables.append(blocks)
            if end == request.num_tokens:
                b.sample_rows.append(row)
                b.logits_indices.append(b.query_start_loc[-1] - 1)
            if request.sampling_params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
                count = min(end, request.num_prompt_tokens - 1) - start
                b.prompt_logprob_spans.append((row, b.query_start_loc[-2], count))
        return b

    def _sampling_metadata(self, requests: list[Request], vocab: int) -> SamplingMetadata:
        dev = self.device
        params = [r.sampling_params for r in requests]

        def column(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=dev)

        temps = [p.temperature for p in params]
        meta = SamplingMetadata(temperature=column(temps), all_greedy=all(t < 1e-5 for t in temps))
        if any(p.top_k for p in params):
            meta.top_k = column([p.top_k or vocab for p in params], torch.long)
        if any(p.top_p < 1.0 for p in params):
            meta.top_p = column([p.top_p for p in params])
        if any(p.min_p > 0.0 for p in params):
            meta.min_p = column([p.min_p for p in params])
        meta.generators = {i: self._generator(r) for i, r in enumerate(requests)
                           if r.sampling_params.seed is not None}
        self._add_penalties(meta, requests, vocab)
        meta.logit_bias = _logit_bias(requests, vocab, dev)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        meta.max_num_logprobs = max(logprobs) if logprobs else None
        return meta

    def _add_penalties(self, meta: SamplingMetadata, requests: list[Request], vocab: int) -> None:
        params = [r.sampling_params for r in requests]
        rep = any(p.repetition_penalty != 1.0 for p in params)
        freq = any(p.frequency_penalty != 0.0 for p in params)
        pres = any(p.presence_penalty != 0.0 for p in params)
        if not (rep or freq or pres):
            return
        dev = self.device
        counts = torch.zeros(len(requests), vocab, device=dev)
        for i, r in enumerate(requests):
            if r.output_token_ids:
                ids = torch.tensor(r.output_token_ids, device=dev)
                counts[i].index_add_(0, ids, torch.ones(len(ids), device=dev))
        meta.output_counts = counts
        if rep:
            meta.prompt_mask = torch.zeros(len(requests), vocab, dtype=torch.bool, device=dev)
            for i, r in enumerate(requests):
                meta.prompt_mask[i, torch.tensor(r.prompt_token_ids, device=dev)] = True
            meta.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], device=dev)
        if freq:
            meta.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=dev)
        if pres:
            meta.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=dev)

    def _collect_samples(self, requests: list[Request], sampled: SamplerOutput, out: ModelRunnerOutput) -> None:
        tokens = sampled.token_ids.tolist()
        if sampled.logprobs is not None:
            ids, lps, ranks = (sampled.logprob_token_ids.tolist(), sampled.logprobs.tolist(),
                               sampled.sampled_ranks.tolist())
        for i, request in enumerate(requests):
            out.sampled[request.request_id] = tokens[i]
            k = request.sampling_params.logprobs
            if k is not None:
                out.logprobs[request.request_id] = (ids[i][:k + 1], lps[i][:k + 1], ranks[i])

    def _prompt_logprobs(self, request: Request, hidden: torch.Tensor, first: int, count: int,
                         batch: _Batch) -> list[TokenLogprobs]:
        start = request.num_computed_tokens
        targets = torch.tensor(request.prompt_token_ids[start + 1:start + 1 + count], device=self.device)
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[first:first + count]).float(), dim=-1)
        chosen = logprobs.gather(-1, targets[:, None])
        ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
        k = request.sampling_params.prompt_logprobs
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], targets[:, None][:, :0])
        ids = torch.cat([targets[:, None], top_ids], dim=1).tolist()
        lps = torch.cat([chosen, top_lp], dim=1).tolist()
        return [(ids[j], lps[j], ranks[j]) for j in range(count)]


def _pad_2d(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)


def _logit_bias(requests: list[Request], vocab: int, device: torch.device) -> torch.Tensor | None:
    """A dense additive bias for the rows that need one: logit_bias, allowed_token_ids, bad words,
    and the stop tokens that min_tokens forbids for now. None when no row needs anything."""
    rows = {}
    for i, request in enumerate(requests):
        bias = _row_bias(request)
        if bias:
            rows[i] = bias
    if not rows:
        return None
    out = torch.zeros(len(requests), vocab, device=device)
    for i, (allowed, additive) in rows.items():
        if allowed is not None:
            out[i] = float("-inf")
            out[i, allowed] = 0.0
        for token, value in additive.items():
            out[i, token] += value
    return out


def _row_bias(request: Request):
    params = request.sampling_params
    additive: dict[int, float] = dict(params.logit_bias or {})
    for token in _banned_tokens(request):
        additive[token] = float("-inf")
    if params.allowed_token_ids is None and not additive:
        return None
    return params.allowed_token_ids, additive


def _banned_tokens(request: Request) -> list[int]:
    params, output = request.sampling_params, request.output_token_ids
    banned = []
    if len(output) < params.min_tokens:
        banned.extend(request.stop_token_set)
    for words in params.bad_words_token_ids:
        prefix = words[:-1]
        if not prefix or output[-len(prefix):] == prefix:
            banned.append(words[-1])
    return banned
