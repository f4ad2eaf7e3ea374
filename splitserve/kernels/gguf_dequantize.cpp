// GGUF weights dequantized whole (gguf_dequantize) or by rows (gguf_embedding), in either layout:
// equal to the gguf package's numpy dequantize, rounded once to the dtype asked for. Registered in
// ops_registry.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_ops.h"
#include "gguf_formats.h"
#include "gguf_repack.h"

#include <cstdint>

namespace splitserve {

at::Tensor gguf_dequantize(const at::Tensor& w, int64_t qtype, int64_t N, int64_t K, at::ScalarType dtype) {
  if (qtype >= kRepacked) {
    return with_repackable_format(qtype - kRepacked, [&](auto format) {
      using Q = decltype(format);
      check_repacked_weight<Q>(w, N, K);
      at::Tensor out = at::empty({N, K}, w.options().dtype(dtype));
      with_dtype(dtype, [&](auto tag) {
        auto* op = out.data_ptr<decltype(tag)>();
        at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
          for (int64_t n = begin; n < end; ++n) dequantize_repacked_row<Q>(w.data_ptr<uint8_t>(), n, K, op + n * K);
        });
      });
      return out;
    });
  }
  return with_format(qtype, [&](auto format) {
    using Q = decltype(format);
    check_weight<Q>(w, N, K);
    at::Tensor out = at::empty({N, K}, w.options().dtype(dtype));
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const int64_t row_bytes = w.size(1);
    with_dtype(dtype, [&](auto tag) {
      auto* op = out.data_ptr<decltype(tag)>();
      at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) dequantize_row<Q>(wp + n * row_bytes, K, op + n * K);
      });
    });
    return out;
  });
}

namespace {

// out [T, K] in dtype: row(id[t], out row t) for every token, ids checked against V.
template <typename Row>
at::Tensor embed(const at::Tensor& ids, int64_t V, int64_t K, const at::TensorOptions& options, at::ScalarType dtype,
                 Row&& row) {
  const int64_t T_ = ids.size(0);
  TORCH_CHECK(T_ == 0 || (ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < V),
              "token ids must lie in [0, ", V, ")");
  at::Tensor out = at::empty({T_, K}, options.dtype(dtype));
  const int64_t* id = ids.data_ptr<int64_t>();
  with_dtype(dtype, [&](auto tag) {
    auto* op = out.data_ptr<decltype(tag)>();
    at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) row(id[t], op + t * K);
    });
  });
  return out;
}

}  // namespace

at::Tensor gguf_embedding(const at::Tensor& ids, const at::Tensor& w, int64_t qtype, int64_t K,
                          at::ScalarType dtype) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.device().is_cpu(),
              "ids must be a contiguous [T] int64 CPU tensor");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (qtype >= kRepacked) {  // a tied LM head repacked for its products (gguf_repack.h)
    return with_repackable_format(qtype - kRepacked, [&](auto format) {
      using Q = decltype(format);
      const int64_t V = w.dim() == 2 ? w.size(0) * kGroupRows : 0;
      check_repacked_weight<Q>(w, V, K);
      return embed(ids, V, K, w.options(), dtype, [&](int64_t n, auto* out) { dequantize_repacked_row<Q>(wp, n, K, out); });
    });
  }
  return with_format(qtype, [&](auto format) {
    using Q = decltype(format);
    const int64_t V = w.dim() == 2 ? w.size(0) : 0, row_bytes = w.dim() == 2 ? w.size(1) : 0;
    check_weight<Q>(w, V, K);
    return embed(ids, V, K, w.options(), dtype, [&](int64_t n, auto* out) { dequantize_row<Q>(wp + n * row_bytes, K, out); });
  });
}

}  // namespace splitserve
