// The interleaved layout of repacked GGUF weights (gguf_repack.cpp makes them; gguf_dequantize.cpp
// and gguf_products.cpp read them): records of 16 rows' blocks, and a row's codes and scales in them.
#pragma once

#include <ATen/ATen.h>

#include "cpu_simd.h"
#include "gguf_formats.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

// ---- weights interleaved for decode's products ------------------------------------------------
// gguf_repack rewrites a Q4_0, Q4_1 or Q8_0 weight so that the few-rows path multiplies 16 output rows at
// once, one row per 32-bit lane of a 512-bit vector (two 256-bit halves on AVX2), as llama.cpp's
// repacked CPU layouts do: a code load serves 16 rows, their scales convert 16 at a time, and no
// row ends in a horizontal sum. The weight becomes [N / 16, 16 * row_bytes] bytes (as many as
// before): per group of 16 rows, per 32-value chunk, a record of 16 blocks' bytes holding
//   16 float16 d (row r's at 2r), for Q4_1 then 16 float16 m, then 256 bytes of codes: four
//   64-byte vectors, vector j holding row r's codes 8j .. 8j + 3 in the low nibbles of its bytes
//   [4r, 4r + 4) and codes 8j + 4 .. 8j + 7 in their high nibbles;
//   for Q8_0: 16 float16 d, then 512 bytes of codes: eight 64-byte vectors, vector j holding row
//   r's codes 4j .. 4j + 3 (int8) in its bytes [4r, 4r + 4).
// Its type id is the ggml one plus kRepacked; gguf_mm and gguf_dequantize take both layouts.
constexpr int64_t kRepacked = 256;
constexpr int64_t kGroupRows = 16;

template <class Q>
struct Record {
  static_assert(std::is_same_v<Q, Q4_0> || std::is_same_v<Q, Q4_1> || std::is_same_v<Q, Q8_0>,
                "only Q4_0, Q4_1 and Q8_0 are repacked");
  static constexpr bool kByteCodes = std::is_same_v<Q, Q8_0>;  // whole int8 codes, not nibbles
  static constexpr int64_t kVectors = kByteCodes ? 8 : 4;       // 64-byte code vectors per record
  static constexpr int64_t kBytes = Q::kBytes * kGroupRows;
  static constexpr int64_t kMinsAt = 2 * kGroupRows;
  static constexpr int64_t kCodesAt = (Q::kHasMin ? 4 : 2) * kGroupRows;

  // row r's scales in the record
  static ChunkScales scales(const uint8_t* rec, int64_t r) {
    const float d = fp16_at(rec + 2 * r);
    return {d, d, Q::kHasMin ? fp16_at(rec + kMinsAt + 2 * r) : 0.f};
  }
};

// fn(Q{}) for the repackable type whose ggml id is qtype.
template <typename Fn>
auto with_repackable_format(int64_t qtype, Fn&& fn) {
  switch (qtype) {
    case Q4_0::kId: return fn(Q4_0{});
    case Q4_1::kId: return fn(Q4_1{});
    case Q8_0::kId: return fn(Q8_0{});
  }
  TORCH_CHECK(false, "GGUF type id ", qtype, " is not repacked here; repacked: Q4_0 (2), Q4_1 (3), Q8_0 (8)");
}

template <class Q>
void check_repacked_weight(const at::Tensor& w, int64_t N, int64_t K) {
  TORCH_CHECK(K > 0 && K % Q::kValues == 0, "K = ", K, " is not a multiple of ", Q::kName, "'s block of ",
              Q::kValues, " values");
  TORCH_CHECK(N > 0 && N % kGroupRows == 0, "a repacked weight has a multiple of ", kGroupRows, " rows, not ", N);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous(),
              "GGUF weights must be a contiguous CPU uint8 tensor, got ", w.scalar_type(), " on ", w.device());
  const int64_t group_bytes = K / Q::kValues * Record<Q>::kBytes;
  TORCH_CHECK(w.dim() == 2 && w.size(0) == N / kGroupRows && w.size(1) == group_bytes, "a repacked ", Q::kName,
              " weight of ", N, " rows of ", K, " values must be [", N / kGroupRows, ", ", group_bytes, "] bytes, got ",
              w.sizes());
}

// Row r's 32 codes of a record's codes, in value order.
#if defined(SPLITSERVE_ISA_AVX2)
template <class Q>
inline __m256i repacked_codes(const uint8_t* codes, int64_t r) {
  if constexpr (Record<Q>::kByteCodes) {
    int32_t words[8];
    for (int j = 0; j < 8; ++j) std::memcpy(&words[j], codes + 64 * j + 4 * r, 4);
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words));
  }
  int32_t words[4];
  for (int j = 0; j < 4; ++j) std::memcpy(&words[j], codes + 64 * j + 4 * r, 4);
  const __m128i n = _mm_loadu_si128(reinterpret_cast<const __m128i*>(words)), low = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(n, low), hi = _mm_and_si128(_mm_srli_epi16(n, 4), low);
  // [lo 0, hi 0, lo 1, hi 1] are values 0-15 and [lo 2, hi 2, lo 3, hi 3] values 16-31
  return _mm256_set_m128i(_mm_unpackhi_epi32(lo, hi), _mm_unpacklo_epi32(lo, hi));
}
#else
template <class Q>
inline void repacked_codes(const uint8_t* codes, int64_t r, int8_t* q) {
  if constexpr (Record<Q>::kByteCodes) {
    for (int v = 0; v < kChunk; ++v) q[v] = static_cast<int8_t>(codes[64 * (v / 4) + 4 * r + v % 4]);
    return;
  }
  for (int v = 0; v < kChunk; ++v) {
    const uint8_t byte = codes[64 * (v / 8) + 4 * r + v % 4];
    q[v] = static_cast<int8_t>(v % 8 < 4 ? byte & 15 : byte >> 4);
  }
}
#endif

// Row n of a repacked weight into out[0, K).
template <class Q, typename T>
void dequantize_repacked_row(const uint8_t* w, int64_t n, int64_t K, T* out) {
  const int64_t chunks = K / kChunk, r = n % kGroupRows;
  const uint8_t* group = w + n / kGroupRows * chunks * Record<Q>::kBytes;
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* rec = group + c * Record<Q>::kBytes;
#if defined(SPLITSERVE_ISA_AVX2)
    dequantize_codes<Q>(repacked_codes<Q>(rec + Record<Q>::kCodesAt, r), Record<Q>::scales(rec, r), out + c * kChunk);
#else
    int8_t q[kChunk];
    repacked_codes<Q>(rec + Record<Q>::kCodesAt, r, q);
    dequantize_codes<Q>(q, Record<Q>::scales(rec, r), out + c * kChunk);
#endif
  }
}

}  // namespace
