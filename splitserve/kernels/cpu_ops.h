// The entry points of cpu_ops.cpp and gguf_ops.cpp that other C++ code of the extension calls
// directly (decode_stack.cpp), without going back through Python or the dispatcher. Each one is
// the function registered under the same name in torch.ops.splitserve_cpu; see its definition for
// the shapes and dtypes it takes.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace splitserve {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps);
void rotary(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);
void write_kv(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping);
void decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, int64_t num_decodes, double scale, int64_t sliding_window);
at::Tensor gguf_mm(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t N, int64_t K, bool native_bf16);

}  // namespace splitserve
