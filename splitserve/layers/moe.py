"""Mixture-of-experts MLP layers: a router picks top-k experts per token, the experts (SiLU-gated MLPs)
compute on the tokens routed to them, and their outputs are summed with the router's weights.

FusedMoE holds every expert's gate/up rows stacked in one parameter, w13 [E, 2 I, H], and its down
projections in w2 [E, H, I], as the Hugging Face checkpoints' 3D expert tensors are (the per-expert
checkpoints load into slices of them). A forward sorts the step's (token, expert) pairs by expert
once, then runs each expert that has tokens as two GEMMs over exactly those tokens, so that a decode
step with few tokens reads only the weights of the experts it selected; each expert's output is
scaled by its routing weight and added into the tokens' rows in expert order, as transformers adds
them. On CUDA, unquantized experts run in one launch per projection instead (layers/moe_backends.py:
the Triton fused-MoE kernels of kernels/triton_moe.py by default, or torch's grouped GEMM), with
nothing waiting for the host, so CUDA graphs capture them.

Parallelism: with tensor parallelism every rank holds a slice of every expert's intermediate
channels (w13 rows and w2 columns, as the dense MLP's column / row split) and the ranks' partial sums
are all-reduced; with expert parallelism (--enable-expert-parallel) each rank holds E / tp whole
experts and computes only their share, and the same all-reduce combines the ranks' outputs (every
rank holds every token, so dispatching is just each rank skipping the experts it does not hold).

Quantized experts (a GGUF file's blocks under --quantization gguf, weight_only_int8 / fp8 applied
while loading, or an AWQ / GPTQ / compressed-tensors W4A16 checkpoint) are one pair of Linears per
expert (gate/up stacked, down) with the model's linear method (layers/moe_quantized.py), split over
the ranks exactly as the dense stacks are; a decode step then reads only the selected experts'
quantized blocks.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from splitserve import kernels
from splitserve.distributed.communication import tp_all_reduce
from splitserve.distributed.parallel_state import get_parallel_rank
from splitserve.kernels import gguf as gguf_kernels
from splitserve.kernels import packed_linear, row_buckets
from splitserve.layers.basic import silu_and_mul
from splitserve.layers.gguf_weight import GGUFWeight
from splitserve.layers.moe_backends import choose_backend, grouped_experts, grouped_mm_works, triton_moe
from splitserve.layers.moe_quantized import expert_linears, tensor_names, whole_tensors
from splitserve.layers.moe_router import RouterRule, choose_experts

__all__ = ["FusedMoE", "RouterRule", "expert_load", "grouped_experts", "grouped_mm_works", "moe_capturable"]

logger = logging.getLogger(__name__)

GATE, UP, DOWN = 0, 1, 2  # which projection of an expert a checkpoint tensor is
_ROUTER_ELEMENTWISE_ROWS = 4  # up to this many rows, router logits without a BLAS call (_router_logits)


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        rule: RouterRule,
        dtype: torch.dtype,
        expert_parallel: bool = False,
        quant_config=None,
        prefix: str = "",
    ):
        super().__init__()
        rank = get_parallel_rank()
        self.tp_rank, self.tp_size = rank.tp_rank, rank.tp_size
        self.num_experts, self.rule, self.hidden_size = num_experts, rule, hidden_size
        self.expert_parallel = expert_parallel and self.tp_size > 1
        if self.expert_parallel:
            if num_experts % self.tp_size:
                raise ValueError(
                    f"--enable-expert-parallel splits the experts over the {self.tp_size} tensor-parallel ranks: "
                    f"{num_experts} experts do not divide into {self.tp_size}."
                )
            self.local_experts = num_experts // self.tp_size
            self.first_expert, self.intermediate = self.tp_rank * self.local_experts, intermediate_size
        else:
            if intermediate_size % self.tp_size:
                raise ValueError(
                    f"The experts' {intermediate_size} intermediate channels cannot be split over {self.tp_size} "
                    "tensor-parallel ranks (--enable-expert-parallel splits whole experts instead)."
                )
            self.local_experts, self.first_expert = num_experts, 0
            self.intermediate = intermediate_size // self.tp_size
        router_dtype = torch.float32 if rule.logits_in_float else dtype
        self.gate = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=router_dtype), requires_grad=False)
        if rule.biased:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        # quantized: per local expert, [gate/up Linear, down Linear] with the model's linear method
        self.quantized: nn.ModuleList | None = None
        # a quantized checkpoint's expert tensors (AWQ's qweight ...) go whole to their Linears (moe_quantized.py)
        self.whole_tensors = quant_config is not None and whole_tensors(quant_config)
        self.checkpoint_tensor_names = tensor_names(quant_config) if quant_config is not None else ()
        if quant_config is not None:
            self.quantized = nn.ModuleList(
                nn.ModuleList(expert_linears(self, quant_config, f"{prefix}.{self.first_expert + e}", dtype))
                for e in range(self.local_experts)
            )
            shape13 = shape2 = (0,)  # the stacks stay empty: they only name what the checkpoint fills
        else:
            shape13 = (self.local_experts, 2 * self.intermediate, hidden_size)
            shape2 = (self.local_experts, hidden_size, self.intermediate)
        self.w13 = nn.Parameter(torch.empty(shape13, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(shape2, dtype=dtype), requires_grad=False)
        self.tokens_per_expert = torch.zeros(num_experts, dtype=torch.long, device="cpu")  # on the host, since start
        # The grouped path's count, on its device (under CUDA graphs the padding rows of a batch count too)
        self.device_tokens_per_expert: torch.Tensor | None = None
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per expert, oneDNN's layout (CPU)
        self._blocks = None  # _gguf_blocks' answer, found at the first forward (after repacking)
        self._gate_float: torch.Tensor | None = None  # the router in float32, for _router_logits

    def pack_weights(self) -> int:
        """bfloat16 experts on CPU: each expert's two matrices prepacked for oneDNN once
        (kernels/packed_linear.py: reordered at every call otherwise, 2x slower at a few rows); the
        stacked copies are dropped. Returns how many matrices were packed. Quantized experts are
        Linears, which pack_cpu_weights repacks as any other."""
        if self.quantized is not None or not packed_linear.enabled() or not packed_linear.can_pack(self.w13[0]):
            return 0
        self.packed = [
            (packed_linear.pack(self.w13[e]), packed_linear.pack(self.w2[e])) for e in range(self.local_experts)
        ]
        self.w13 = nn.Parameter(self.w13.data.new_empty(0), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.data.new_empty(0), requires_grad=False)
        return 2 * self.local_experts

    # --- loading -------------------------------------------------------------------------------
    def checkpoint_shards(self, name: str) -> list[int]:
        """The pieces of parameter `name` the checkpoint must fill on this rank (load_weights' check)."""
        experts = range(self.first_expert, self.first_expert + self.local_experts)
        if self.whole_tensors and name in ("w13", "w2"):
            return []  # each expert's Linear checks that its method's tensors arrived
        if name == "w13":
            return [3 * e + p for e in experts for p in (GATE, UP)]
        if name == "w2":
            return [3 * e + DOWN for e in experts]
        return [0]

    def load_checkpoint_tensor(self, name: str, shard: int | None, tensor: torch.Tensor) -> list[int]:
        """`shard` = 3 * expert + GATE/UP/DOWN for one expert's projection [rows, cols] (`name` w13 / w2,
        or a quantized checkpoint's tensor: qweight ...), or None for a whole 3D tensor (every expert)
        of w13 or w2, or the router's weight or its correction. Returns the pieces it filled on this
        rank (checkpoint_shards' ids)."""
        if name in ("gate", "e_score_correction_bias"):
            param = getattr(self, name)
            if isinstance(tensor, GGUFWeight):  # a GGUF router (llama.cpp keeps it float32)
                tensor = tensor.dense(torch.float32)
            _copy(param.data, tensor.reshape(param.shape) if tensor.numel() == param.numel() else tensor, name)
            return [0]
        if shard is not None:
            return self._load_expert(shard // 3, shard % 3, tensor, "weight" if name in ("w13", "w2") else name)
        filled = []
        for expert in range(self.num_experts):
            if name == "w13":
                half = tensor.shape[1] // 2
                filled += self._load_expert(expert, GATE, tensor[expert, :half])
                filled += self._load_expert(expert, UP, tensor[expert, half:])
            else:
                filled += self._load_expert(expert, DOWN, tensor[expert])
        return filled

    def _load_expert(self, expert: int, projection: int, tensor: torch.Tensor, kind: str = "weight") -> list[int]:
        local = expert - self.first_expert
        if not 0 <= local < self.local_experts:
            return []  # another rank's expert (expert parallelism)
        if self.whole_tensors:
            linear = self.quantized[local][1 if projection == DOWN else 0]
            linear.load_checkpoint_tensor(kind, None if projection == DOWN else projection, tensor)
            return [3 * expert + projection]
        share = (
            slice(None)
            if self.expert_parallel
            else slice(self.tp_rank * self.intermediate, (self.tp_rank + 1) * self.intermediate)
        )
        if self.quantized is not None:
            linear = self.quantized[local][1 if projection == DOWN else 0]
            rows, cols = (slice(None), share) if projection == DOWN else (share, slice(None))
            part = tensor.take(rows, cols) if isinstance(tensor, GGUFWeight) else tensor[rows, cols]
            linear.load_checkpoint_tensor("weight", None if projection == DOWN else projection, part)
            return [3 * expert + projection]
        if projection == DOWN:
            _copy(self.w2.data[local], tensor[:, share], f"expert {expert}'s down projection")
        else:
            rows = slice(projection * self.intermediate, (projection + 1) * self.intermediate)
            _copy(self.w13.data[local, rows], tensor[share], f"expert {expert}'s gate/up projection")
        return [3 * expert + projection]

    # --- forward -------------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) by the model's rule."""
        logits = self._router_logits(x.float() if self.rule.logits_in_float else x)
        bias = self.e_score_correction_bias if self.rule.biased else None
        return choose_experts(self.rule, logits, bias, x.dtype)

    def _router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x @ gate.T. A few rows on CPU (decode) as products summed in float32 rather than a BLAS
        call: MKL's small GEMM wakes its own thread team, which then contends with the kernels' OpenMP
        threads (measured in a single-stream decode step: 29 us per router call instead of 3 us
        alone, and the experts' kernel after it 17% slower)."""
        if x.device.type != "cpu" or x.shape[0] > _ROUTER_ELEMENTWISE_ROWS:
            return F.linear(x, self.gate)
        if self._gate_float is None:
            self._gate_float = self.gate.float()
        return (x.float()[:, None, :] * self._gate_float).sum(-1).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        return tp_all_reduce(out) if self.tp_size > 1 else out

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over each token's k experts of weight * expert(x), for the experts this rank holds."""
        blocks = self._gguf_blocks(x)
        if blocks is not None:  # every expert in GGUF blocks of one type: the whole layer in one C++ call
            self.tokens_per_expert += torch.bincount(ids.reshape(-1), minlength=self.num_experts)
            gate_up, qtype_gate_up, down, qtype_down = blocks
            return gguf_kernels.moe_experts(
                x, ids, weights, gate_up, qtype_gate_up, down, qtype_down, self.first_expert, self.intermediate
            )
        backend = self.backend(x.device, x.dtype)
        if backend != "loop":
            if self.device_tokens_per_expert is None:
                self.device_tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
            if backend == "triton":
                counts = self.device_tokens_per_expert  # added to in place: a captured graph's replays count too
                return triton_moe().fused_experts(x, weights, ids, self.w13, self.w2, expert_counts=counts)
            out, counts = grouped_experts(x, weights, ids, self.w13, self.w2)
            self.device_tokens_per_expert += counts  # in place, as above
            return out
        out = torch.zeros_like(x)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        self.tokens_per_expert += torch.tensor(counts)
        pair_weights = weights.reshape(-1)
        start = sum(counts[: self.first_expert])
        for local in range(self.local_experts):
            count = counts[self.first_expert + local]
            if count == 0:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = pairs // k
            h = silu_and_mul(self._product(x.index_select(0, tokens), local, 0))
            h = self._product(h, local, 1) * pair_weights.index_select(0, pairs)[:, None]
            out.index_add_(0, tokens, h.to(out.dtype))
        return out

    def backend(self, device: torch.device, dtype: torch.dtype) -> str:
        """Which experts' path a forward on `device` in `dtype` runs: "triton" or "grouped_mm" (no host
        synchronisation, so CUDA graphs can capture them) or "loop" (`experts`, expert by expert);
        layers/moe_backends.py says how it is chosen (CUDA, unquantized, every expert on this rank,
        SPLITSERVE_MOE_BACKEND)."""
        all_local = self.local_experts == self.num_experts
        quantized = self.quantized is not None
        return choose_backend(device, dtype, quantized, all_local, self.hidden_size, self.intermediate)

    def grouped(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a forward on `device` in `dtype` runs torch's grouped GEMM (`grouped_experts`)."""
        return self.backend(device, dtype) == "grouped_mm"

    def _gguf_blocks(self, x: torch.Tensor):
        """(gate/up blocks per expert, their ggml type, down blocks per expert, their type) when every
        local expert's two matrices are each one run of GGUF blocks of a type the C++ kernels take (the
        same for all experts) and x is a CPU float32 / bfloat16 tensor; else None (per-expert Linears)."""
        if self._blocks is None:
            self._blocks = self._find_gguf_blocks() or False
        if not self._blocks or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
            return None
        return self._blocks

    def _find_gguf_blocks(self):
        if self.quantized is None or kernels.cpu_ops() is None:
            return None
        found: list[list[tuple[int, torch.Tensor]]] = [[], []]
        for pair in self.quantized:
            for which, linear in enumerate(pair):
                runs = getattr(linear, "gguf_runs", None)
                if not runs or len(runs) != 1 or runs[0][0] is None:
                    return None
                qtype, _, name = runs[0]
                found[which].append((qtype, getattr(linear, name)))
        qtypes = [{q for q, _ in found[w]} for w in (0, 1)]
        if any(len(q) != 1 or not gguf_kernels.has_kernel(next(iter(q))) for q in qtypes):
            return None
        return [b for _, b in found[0]], qtypes[0].pop(), [b for _, b in found[1]], qtypes[1].pop()

    def _product(self, x: torch.Tensor, local: int, which: int) -> torch.Tensor:
        """x @ W.T for local expert `local`'s gate/up (0) or down (1) matrix."""
        if self.quantized is not None:
            return self.quantized[local][which](x)
        if self.packed is not None:
            return packed_linear.linear(x, self.packed[local][which])
        return row_buckets.linear(x, (self.w13, self.w2)[which][local])


def moe_capturable(model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a CUDA graph can capture every MoE layer of `model` (each runs the Triton kernels or
    `grouped_experts`, not the expert-by-expert loop); True for a model without one."""
    return all(m.backend(device, dtype) != "loop" for m in model.modules() if isinstance(m, FusedMoE))


def expert_load(model: nn.Module) -> dict[int, list[int]]:
    """Tokens routed to each expert since start, by MoE layer index, for the layers `model` holds
    (every tensor-parallel rank routes every token, so any rank of a stage gives its layers' counts)."""
    loads = {}
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            counts = module.tokens_per_expert
            if module.device_tokens_per_expert is not None:
                counts = counts + module.device_tokens_per_expert.cpu()
            loads[int(name.split(".")[2])] = counts.tolist()
    return loads


def _copy(dest: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if dest.shape != tensor.shape:
        raise ValueError(f"Checkpoint tensor for {what} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}.")
    dest.copy_(tensor)
