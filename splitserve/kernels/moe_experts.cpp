// A mixture-of-experts layer's experts on GGUF weights, in one call (splitserve.layers.moe's
// quantized decode path): for each expert this rank holds that a step's tokens chose, the tokens'
// rows go through its gate/up product, SiLU-and-multiply and its down product (gguf_mm on the
// expert's blocks, repacked or not), and each result, scaled by the token's routing weight, is added
// into the token's output row. Only the chosen experts' blocks are read.
//
// The sums follow the Python path and transformers: experts in id order, each product scaled in the
// dtype of the routing weights then rounded to x's dtype, and added into an output of x's dtype.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "cpu_ops.h"

namespace {

template <class T, class W>
void add_scaled(T* out, const T* y, int64_t H, W weight) {
  const float w = static_cast<float>(weight);
  for (int64_t h = 0; h < H; ++h) {
    const W scaled = static_cast<W>(static_cast<float>(y[h]) * w);
    out[h] = static_cast<T>(static_cast<float>(out[h]) + static_cast<float>(static_cast<T>(scaled)));
  }
}

}  // namespace

namespace splitserve {

// x [T, H] float32 or bfloat16; ids [T, k] int64 expert ids (the model's numbering); weights [T, k]
// float32 or x's dtype; gate_up[e] / down[e]: local expert e's blocks (experts first_expert ...),
// of ggml types qtype_gate_up ([2 I, H]) and qtype_down ([H, I]).
at::Tensor moe_experts_gguf(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                            at::TensorList gate_up, int64_t qtype_gate_up, at::TensorList down, int64_t qtype_down,
                            int64_t first_expert, int64_t intermediate, bool native_bf16) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, H] tensor");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong, "ids must be [T, k] int64");
  TORCH_CHECK(weights.sizes() == ids.sizes(), "weights must have the shape of ids");
  TORCH_CHECK(gate_up.size() == down.size(), "one gate/up and one down matrix per expert");
  TORCH_CHECK(weights.scalar_type() == at::kFloat || weights.scalar_type() == x.scalar_type(),
              "weights must be float32 or x's dtype");
  const int64_t T_ = x.size(0), H = x.size(1), k = ids.size(1), local = static_cast<int64_t>(gate_up.size());
  const at::Tensor ids_c = ids.contiguous();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> pairs(local);  // per local expert: (token * k + slot), in token order
  for (int64_t p = 0; p < T_ * k; ++p) {
    const int64_t e = id[p] - first_expert;
    if (e >= 0 && e < local) pairs[e].push_back(p);
  }
  at::Tensor out = at::zeros_like(x);
  const at::Tensor w_c = weights.contiguous();
  for (int64_t e = 0; e < local; ++e) {
    const auto& chosen = pairs[e];
    if (chosen.empty()) continue;
    const int64_t m = static_cast<int64_t>(chosen.size());
    at::Tensor rows = at::empty({m}, ids.options());
    int64_t* r = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < m; ++i) r[i] = chosen[i] / k;
    const at::Tensor xe = m == T_ && T_ == 1 ? x : x.index_select(0, rows);
    const at::Tensor h = gguf_mm(xe, gate_up[e], qtype_gate_up, 2 * intermediate, H, native_bf16, 0);
    const at::Tensor y = gguf_mm(silu_and_mul(h), down[e], qtype_down, H, intermediate, native_bf16, 0);
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "moe_experts_gguf", [&] {
      using T = scalar_t;
      T* o = out.data_ptr<T>();
      const T* yp = y.data_ptr<T>();
      for (int64_t i = 0; i < m; ++i) {
        const int64_t p = chosen[i], t = p / k;
        if (w_c.scalar_type() == at::kFloat)
          add_scaled<T, float>(o + t * H, yp + i * H, H, w_c.data_ptr<float>()[p]);
        else
          add_scaled<T, T>(o + t * H, yp + i * H, H, w_c.data_ptr<T>()[p]);
      }
    });
  }
  return out;
}

}  // namespace splitserve
