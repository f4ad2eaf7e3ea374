// The entry points of splitserve's C++ CPU kernels, one for each operator of torch.ops.splitserve_cpu.
// ops_registry.cpp registers them under the same names, and other C++ code of the extension
// (decode_stack.cpp) calls them directly, without going back through Python or the dispatcher. See
// each definition for the shapes and dtypes it takes:
//   elementwise.cpp       rms_norm, add_rms_norm, rotary, silu_and_mul
//   decode_attention.cpp  write_kv, decode_attention
//   prefill_attention.cpp prefill_attention, set_prompt_attention_brgemm
//   sampling.cpp          sample
//   gguf_products.cpp     gguf_mm
//   gguf_dequantize.cpp   gguf_dequantize, gguf_embedding
//   gguf_repack.cpp       gguf_repack
//   moe_experts.cpp       moe_experts_gguf
//   decode_stack.cpp      register_decode_stack (the DecodeStack class and decode_stack_forward)
//   shm_all_reduce.cpp    register_shm_all_reduce (the ShmAllReduce class and shm_all_reduce)
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace torch {
class Library;
}  // namespace torch

namespace splitserve {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps);
void rotary(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);

void write_kv(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping);
void decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, int64_t num_decodes, double scale, int64_t sliding_window);
void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens,
                       const at::Tensor& query_start_loc, int64_t first, double scale, int64_t sliding_window);
// Whether prompt attention's products go through oneDNN's block kernels instead of its own vector
// loops, from now on in this process: those it computes in float32, and its bfloat16 pairs (AMX
// tiles on a CPU with AMX). Returns the old settings.
std::tuple<bool, bool> set_prompt_attention_brgemm(bool float32, bool bfloat16);

std::tuple<at::Tensor, at::Tensor> sample(const at::Tensor& logits, const at::Tensor& temperature,
                                          const at::Tensor& u);

// path: 0 by row count, 1 integers, 2 dequantized tiles (gguf_products.cpp)
at::Tensor gguf_mm(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t N, int64_t K, bool native_bf16,
                   int64_t path);
at::Tensor gguf_dequantize(const at::Tensor& w, int64_t qtype, int64_t N, int64_t K, at::ScalarType dtype);
at::Tensor gguf_embedding(const at::Tensor& ids, const at::Tensor& w, int64_t qtype, int64_t K,
                          at::ScalarType dtype);
at::Tensor gguf_repack(const at::Tensor& w, int64_t qtype, int64_t N, int64_t K);
at::Tensor moe_experts_gguf(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                            at::TensorList gate_up, int64_t qtype_gate_up, at::TensorList down, int64_t qtype_down,
                            int64_t first_expert, int64_t intermediate, bool native_bf16);

// The DecodeStack class and its decode_stack_forward operator, into the library being registered.
void register_decode_stack(torch::Library& m);
// The ShmAllReduce class (shm_all_reduce.h) and its shm_all_reduce operator.
void register_shm_all_reduce(torch::Library& m);

}  // namespace splitserve
