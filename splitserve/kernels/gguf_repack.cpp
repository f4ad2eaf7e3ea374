// gguf_repack: Q4_0, Q4_1 and Q8_0 weights rewritten in the interleaved layout of gguf_repack.h, 16 rows
// at a time, for the few-rows products of gguf_products.cpp. Registered in ops_registry.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_ops.h"
#include "gguf_formats.h"
#include "gguf_repack.h"

#include <cstdint>
#include <cstring>

namespace {

// Chunk c of 16 rows (rows[r * row_bytes] onwards) into its record.
template <class Q>
void repack_record(const uint8_t* rows, int64_t row_bytes, int64_t c, uint8_t* rec) {
  uint8_t* codes = rec + Record<Q>::kCodesAt;
  for (int64_t r = 0; r < kGroupRows; ++r) {
    const uint8_t* block = rows + r * row_bytes + c * Q::kBytes;
    std::memcpy(rec + 2 * r, block, 2);
    if constexpr (Q::kHasMin) std::memcpy(rec + Record<Q>::kMinsAt + 2 * r, block + 2, 2);
    if constexpr (Record<Q>::kByteCodes) {  // value 4j + b of the block's 32 int8 codes (after d)
      for (int j = 0; j < 8; ++j)
        for (int b = 0; b < 4; ++b) codes[64 * j + 4 * r + b] = block[2 + 4 * j + b];
      continue;
    }
    const uint8_t* qs = block + (Q::kHasMin ? 4 : 2);  // value i in the low nibble of byte i, i + 16 in its high one
    uint8_t code[kChunk];
    for (int i = 0; i < 16; ++i) code[i] = qs[i] & 15, code[i + 16] = qs[i] >> 4;
    for (int j = 0; j < 4; ++j)
      for (int b = 0; b < 4; ++b)
        codes[64 * j + 4 * r + b] = static_cast<uint8_t>(code[8 * j + b] | (code[8 * j + 4 + b] << 4));
  }
}

}  // namespace

namespace splitserve {

at::Tensor gguf_repack(const at::Tensor& w, int64_t qtype, int64_t N, int64_t K) {
  return with_repackable_format(qtype, [&](auto format) {
    using Q = decltype(format);
    check_weight<Q>(w, N, K);
    TORCH_CHECK(N % kGroupRows == 0, "only weights of a multiple of ", kGroupRows, " rows are repacked, not ", N);
    const int64_t row_bytes = w.size(1), chunks = K / kChunk;
    at::Tensor out = at::empty({N / kGroupRows, kGroupRows * row_bytes}, w.options());
    const uint8_t* wp = w.data_ptr<uint8_t>();
    uint8_t* op = out.data_ptr<uint8_t>();
    at::parallel_for(0, N / kGroupRows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g)
        for (int64_t c = 0; c < chunks; ++c)
          repack_record<Q>(wp + g * kGroupRows * row_bytes, row_bytes, c, op + g * out.size(1) + c * Record<Q>::kBytes);
    });
    return out;
  });
}

}  // namespace splitserve
