// The GGUF (ggml) block formats that splitserve's GGUF kernels take, and their dequantization:
// each type's layout and scales, its codes unpacked (with AVX2 vectors or plain loops), and whole
// rows dequantized. Included by gguf_dequantize.cpp, gguf_repack.cpp and gguf_products.cpp; the
// Python side is splitserve/kernels/gguf.py.
//
// A weight is a uint8 tensor [N, row_bytes]: row n holds the blocks of output row n exactly as they
// lie in the .gguf file, K / block_values blocks of block_bytes each. Every supported type splits
// into chunks of 32 values (one per block for Q4_0 .. Q8_0, eight per 256-value super-block for the
// K-quants) whose values are
//     scale_lo * (code - offset) [+ min]   for the chunk's first 16 values,
//     scale_hi * (code - offset) [+ min]   for its last 16,
// with integer codes of 4 to 8 bits, an offset fixed by the type (8, 16, 32 or 0) and, for the
// types with one, a min (Q4_1, Q5_1, and the K-quants' -dmin * m). Only Q6_K has two scales per
// chunk: its scales cover 16 values. Each type's struct below says where its codes and scales lie.
//
// Like cpu_simd.h, everything here has internal linkage (an unnamed namespace): each kernel file
// compiles and inlines what it uses on its own.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include "cpu_simd.h"

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kChunk = 32;  // values per chunk: the unit of scales and of the quantized x

inline float fp16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// The scales of one chunk: its values are lo * (code - offset) for the first 16 and
// hi * (code - offset) for the last 16, plus min for the types that have one.
struct ChunkScales {
  float lo, hi, min;
};

// ---- the block formats ------------------------------------------------------------------------
// Each: kId (ggml's type id), kValues and kBytes per block, kOffset subtracted from the codes,
// kSigned (int8 codes rather than small unsigned ones), kHasMin, and scales(block, chunk), computed
// in float32 as gguf's numpy reference does so that dequantized values match it exactly. Where the
// codes lie is said here; they are unpacked further down (codes<Q>), once per instruction set.

// Q4_0: d (fp16), 16 bytes of nibbles (value i < 16 in the low nibble of byte i, value i + 16 in
// its high nibble). d * (code - 8).
struct Q4_0 {
  static constexpr int64_t kId = 2, kValues = 32, kBytes = 18, kOffset = 8;
  static constexpr bool kSigned = false, kHasMin = false;
  static constexpr const char* kName = "Q4_0";
  static ChunkScales scales(const uint8_t* b, int64_t) { return {fp16_at(b), fp16_at(b), 0.f}; }
};

// Q4_1: d, m (fp16), 16 bytes of nibbles as Q4_0's. d * code + m.
struct Q4_1 {
  static constexpr int64_t kId = 3, kValues = 32, kBytes = 20, kOffset = 0;
  static constexpr bool kSigned = false, kHasMin = true;
  static constexpr const char* kName = "Q4_1";
  static ChunkScales scales(const uint8_t* b, int64_t) { return {fp16_at(b), fp16_at(b), fp16_at(b + 2)}; }
};

// Q5_0: d (fp16), the fifth bits (bit i of a little-endian 32-bit word for value i), 16 bytes of
// nibbles. d * (code - 16).
struct Q5_0 {
  static constexpr int64_t kId = 6, kValues = 32, kBytes = 22, kOffset = 16;
  static constexpr bool kSigned = false, kHasMin = false;
  static constexpr const char* kName = "Q5_0";
  static ChunkScales scales(const uint8_t* b, int64_t) { return {fp16_at(b), fp16_at(b), 0.f}; }
};

// Q5_1: d, m (fp16), the fifth bits, 16 bytes of nibbles. d * code + m.
struct Q5_1 {
  static constexpr int64_t kId = 7, kValues = 32, kBytes = 24, kOffset = 0;
  static constexpr bool kSigned = false, kHasMin = true;
  static constexpr const char* kName = "Q5_1";
  static ChunkScales scales(const uint8_t* b, int64_t) { return {fp16_at(b), fp16_at(b), fp16_at(b + 2)}; }
};

// Q8_0: d (fp16), 32 int8 codes. d * code.
struct Q8_0 {
  static constexpr int64_t kId = 8, kValues = 32, kBytes = 34, kOffset = 0;
  static constexpr bool kSigned = true, kHasMin = false;
  static constexpr const char* kName = "Q8_0";
  static ChunkScales scales(const uint8_t* b, int64_t) { return {fp16_at(b), fp16_at(b), 0.f}; }
};

// The K-quants' eight 6-bit scales and mins in 12 bytes: bytes 0-3 hold scales 0-3 and bytes 4-7
// mins 0-3 in their low 6 bits; scales and mins 4-7 take their low 4 bits from the low and high
// nibbles of bytes 8-11 and their top 2 bits from the top bits of bytes 0-3 and 4-7.
inline void k_scale_and_min(const uint8_t* s, int64_t j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Chunk j of a Q4_K / Q5_K block: (d * scale_j) * code - dmin * min_j.
inline ChunkScales k_scales(const uint8_t* b, int64_t chunk) {
  int scale, min;
  k_scale_and_min(b + 4, chunk, scale, min);
  const float s = fp16_at(b) * static_cast<float>(scale);
  return {s, s, -(fp16_at(b + 2) * static_cast<float>(min))};
}

// Q4_K: d, dmin (fp16), 12 bytes of scales and mins, 128 bytes of nibbles: chunks 2i and 2i + 1 in
// the low and high nibbles of bytes [32i, 32i + 32).
struct Q4_K {
  static constexpr int64_t kId = 12, kValues = 256, kBytes = 144, kOffset = 0;
  static constexpr bool kSigned = false, kHasMin = true;
  static constexpr const char* kName = "Q4_K";
  static ChunkScales scales(const uint8_t* b, int64_t c) { return k_scales(b, c); }
};

// Q5_K: as Q4_K with 32 bytes of fifth bits before the nibbles: bit j of byte i for value i of
// chunk j.
struct Q5_K {
  static constexpr int64_t kId = 13, kValues = 256, kBytes = 176, kOffset = 0;
  static constexpr bool kSigned = false, kHasMin = true;
  static constexpr const char* kName = "Q5_K";
  static ChunkScales scales(const uint8_t* b, int64_t c) { return k_scales(b, c); }
};

// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales (one per 16 values),
// d (fp16). (d * scale) * (code - 32). Each half of the block (chunks 4h .. 4h + 3) has 64 bytes of
// nibbles, chunk 4h + k in the low (k < 2) or high nibbles of bytes [32 (k % 2), 32 (k % 2) + 32),
// and 32 bytes of high parts, chunk 4h + k in bits 2k and 2k + 1.
struct Q6_K {
  static constexpr int64_t kId = 14, kValues = 256, kBytes = 210, kOffset = 32;
  static constexpr bool kSigned = false, kHasMin = false;
  static constexpr const char* kName = "Q6_K";
  static ChunkScales scales(const uint8_t* b, int64_t c) {
    const float d = fp16_at(b + 208);
    const auto* s = reinterpret_cast<const int8_t*>(b + 192 + 2 * c);
    return {d * static_cast<float>(s[0]), d * static_cast<float>(s[1]), 0.f};
  }
};

// fn(Q{}) for the struct of ggml type id qtype.
template <typename Fn>
auto with_format(int64_t qtype, Fn&& fn) {
  switch (qtype) {
    case Q4_0::kId: return fn(Q4_0{});
    case Q4_1::kId: return fn(Q4_1{});
    case Q5_0::kId: return fn(Q5_0{});
    case Q5_1::kId: return fn(Q5_1{});
    case Q8_0::kId: return fn(Q8_0{});
    case Q4_K::kId: return fn(Q4_K{});
    case Q5_K::kId: return fn(Q5_K{});
    case Q6_K::kId: return fn(Q6_K{});
  }
  TORCH_CHECK(false, "GGUF type id ", qtype, " has no kernel here; supported: Q4_0 (2), Q4_1 (3), Q5_0 (6), ",
              "Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14)");
}

template <class Q>
void check_weight(const at::Tensor& w, int64_t N, int64_t K) {
  TORCH_CHECK(K > 0 && K % Q::kValues == 0, "K = ", K, " is not a multiple of ", Q::kName, "'s block of ",
              Q::kValues, " values");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte,
              "GGUF weights must be a CPU uint8 tensor of raw blocks, got ", w.scalar_type(), " on ", w.device());
  const int64_t row_bytes = K / Q::kValues * Q::kBytes;
  TORCH_CHECK(w.dim() == 2 && w.size(0) == N && w.size(1) == row_bytes, "a ", Q::kName, " weight of ", N,
              " rows of ", K, " values must be [", N, ", ", row_bytes, "] bytes, got ", w.sizes());
  TORCH_CHECK(w.is_contiguous(), "GGUF weights must be contiguous");
}

#if defined(SPLITSERVE_ISA_AVX2)
// ---- codes, vectors: codes<Q>(block, chunk) = the chunk's 32 codes as bytes, in value order ------
// 16 bytes of nibbles: the low nibbles are values 0-15, the high ones 16-31.
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}

// bit i of the word at qh -> 0x10 in byte i: each byte of the word is copied to the 8 bytes it
// covers, and each of those tests its own bit.
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof(bits));
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                                              2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// 32 bytes holding two chunks as nibbles: the low ones (high = false) or the high ones.
inline __m256i nibbles_of_pair(const uint8_t* qs, bool high) {
  const __m256i v = load256(qs);
  return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
}

// Bits [shift, shift + width) of each of 32 bytes, moved to bits [4, 4 + width) (mask says which):
// the high parts of K-quant codes. 16-bit shifts move bits across bytes; the mask keeps each byte's own.
inline __m256i high_bits(const uint8_t* p, int64_t shift, char mask) {
  const __m256i v = _mm256_srl_epi16(load256(p), _mm_cvtsi64_si128(shift));
  return _mm256_and_si256(_mm256_slli_epi16(v, 4), _mm256_set1_epi8(mask));
}

template <class Q>
__m256i codes(const uint8_t* b, int64_t c);
template <>
inline __m256i codes<Q4_0>(const uint8_t* b, int64_t) { return nibbles(b + 2); }
template <>
inline __m256i codes<Q4_1>(const uint8_t* b, int64_t) { return nibbles(b + 4); }
template <>
inline __m256i codes<Q5_0>(const uint8_t* b, int64_t) { return _mm256_or_si256(nibbles(b + 6), fifth_bits(b + 2)); }
template <>
inline __m256i codes<Q5_1>(const uint8_t* b, int64_t) { return _mm256_or_si256(nibbles(b + 8), fifth_bits(b + 4)); }
template <>
inline __m256i codes<Q8_0>(const uint8_t* b, int64_t) { return load256(b + 2); }
template <>
inline __m256i codes<Q4_K>(const uint8_t* b, int64_t c) { return nibbles_of_pair(b + 16 + 32 * (c / 2), c % 2); }
template <>
inline __m256i codes<Q5_K>(const uint8_t* b, int64_t c) {
  return _mm256_or_si256(nibbles_of_pair(b + 48 + 32 * (c / 2), c % 2), high_bits(b + 16, c, 0x10));
}
template <>
inline __m256i codes<Q6_K>(const uint8_t* b, int64_t c) {
  const int64_t h = c / 4, k = c % 4;
  return _mm256_or_si256(nibbles_of_pair(b + 64 * h + 32 * (k % 2), k >= 2), high_bits(b + 128 + 32 * h, 2 * k, 0x30));
}

// ---- dequantized values to T: scale * (code - offset) [+ min] in float32, then stored as T -------
#if defined(SPLITSERVE_ISA_AVX512)
// out[0, 16) = scale * q [+ min] for the 16 int8 in q.
template <bool kHasMin, typename T>
inline void scale_half(__m128i q, float scale, float min, T* out) {
  __m512 v = _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
  if constexpr (kHasMin) v = _mm512_add_ps(v, _mm512_set1_ps(min));
  store(out, v);
}
#else
// out[0, 16) = scale * q [+ min] for the 16 int8 in q, 8 at a time.
template <bool kHasMin, typename T>
inline void scale_half(__m128i q, float scale, float min, T* out) {
  for (int part = 0; part < 2; ++part) {
    const __m128i eight = part ? _mm_srli_si128(q, 8) : q;
    __m256 v = _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)));
    if constexpr (kHasMin) v = _mm256_add_ps(v, _mm256_set1_ps(min));
    store(out + 8 * part, v);
  }
}
#endif

// A chunk's 32 codes (value order) with its scales into out[0, 32): scale * (code - offset) [+ min]
// in float32, then rounded to T once, as gguf's numpy dequantize followed by a cast.
template <class Q, typename T>
inline void dequantize_codes(__m256i codes, const ChunkScales& s, T* out) {
  // code - offset fits an int8 for every type: the offsets go with codes below 64
  const __m256i q = _mm256_sub_epi8(codes, _mm256_set1_epi8(static_cast<char>(Q::kOffset)));
  scale_half<Q::kHasMin>(_mm256_castsi256_si128(q), s.lo, s.min, out);
  scale_half<Q::kHasMin>(_mm256_extracti128_si256(q, 1), s.hi, s.min, out + 16);
}

#else
// ---- codes, plain loops: codes<Q>(block, chunk, q) puts value i's code in q[i] -------------------
inline void nibbles(const uint8_t* qs, int8_t* q) {
  for (int i = 0; i < 16; ++i) {
    q[i] = static_cast<int8_t>(qs[i] & 15);
    q[i + 16] = static_cast<int8_t>(qs[i] >> 4);
  }
}

inline void add_fifth_bits(const uint8_t* qh, int8_t* q) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof(bits));
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(q[i] | (((bits >> i) & 1) << 4));
}

// Bits [shift, shift + width) of 32 bytes p ORed into bits [4, 4 + width) of q.
inline void add_high_bits(const uint8_t* p, int64_t shift, int width_mask, int8_t* q) {
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(q[i] | (((p[i] >> shift) & width_mask) << 4));
}

inline void nibbles_of_pair(const uint8_t* qs, bool high, int8_t* q) {
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>((qs[i] >> (high ? 4 : 0)) & 15);
}

template <class Q>
void codes(const uint8_t* b, int64_t c, int8_t* q);
template <>
inline void codes<Q4_0>(const uint8_t* b, int64_t, int8_t* q) { nibbles(b + 2, q); }
template <>
inline void codes<Q4_1>(const uint8_t* b, int64_t, int8_t* q) { nibbles(b + 4, q); }
template <>
inline void codes<Q5_0>(const uint8_t* b, int64_t, int8_t* q) {
  nibbles(b + 6, q);
  add_fifth_bits(b + 2, q);
}
template <>
inline void codes<Q5_1>(const uint8_t* b, int64_t, int8_t* q) {
  nibbles(b + 8, q);
  add_fifth_bits(b + 4, q);
}
template <>
inline void codes<Q8_0>(const uint8_t* b, int64_t, int8_t* q) { std::memcpy(q, b + 2, kChunk); }
template <>
inline void codes<Q4_K>(const uint8_t* b, int64_t c, int8_t* q) { nibbles_of_pair(b + 16 + 32 * (c / 2), c % 2, q); }
template <>
inline void codes<Q5_K>(const uint8_t* b, int64_t c, int8_t* q) {
  nibbles_of_pair(b + 48 + 32 * (c / 2), c % 2, q);
  add_high_bits(b + 16, c, 1, q);
}
template <>
inline void codes<Q6_K>(const uint8_t* b, int64_t c, int8_t* q) {
  const int64_t h = c / 4, k = c % 4;
  nibbles_of_pair(b + 64 * h + 32 * (k % 2), k >= 2, q);
  add_high_bits(b + 128 + 32 * h, 2 * k, 3, q);
}

// A chunk's 32 codes with its scales into out[0, 32), as gguf's numpy dequantize followed by a cast to T.
template <class Q, typename T>
inline void dequantize_codes(const int8_t* q, const ChunkScales& s, T* out) {
  for (int i = 0; i < kChunk; ++i) {
    const float v = (i < 16 ? s.lo : s.hi) * static_cast<float>(q[i] - Q::kOffset);
    out[i] = static_cast<T>(Q::kHasMin ? v + s.min : v);
  }
}
#endif

// Chunk c of a block into out[0, 32).
template <class Q, typename T>
inline void dequantize_chunk(const uint8_t* block, int64_t c, T* out) {
#if defined(SPLITSERVE_ISA_AVX2)
  dequantize_codes<Q>(codes<Q>(block, c), Q::scales(block, c), out);
#else
  int8_t q[kChunk];
  codes<Q>(block, c, q);
  dequantize_codes<Q>(q, Q::scales(block, c), out);
#endif
}

// ---- dequantization ---------------------------------------------------------------------------
// fn(T{}) for the C++ type T of dtype: float32, bfloat16 or float16.
template <typename Fn>
void with_dtype(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::kFloat) return fn(float{});
  if (dtype == at::kBFloat16) return fn(c10::BFloat16{});
  TORCH_CHECK(dtype == at::kHalf, "GGUF weights dequantize to float32, bfloat16 or float16, not ", dtype);
  fn(c10::Half{});
}

template <class Q, typename T>
void dequantize_row(const uint8_t* row, int64_t K, T* out) {
  constexpr int64_t per_block = Q::kValues / kChunk;
  for (int64_t g = 0; g < K / kChunk; ++g)
    dequantize_chunk<Q>(row + g / per_block * Q::kBytes, g % per_block, out + g * kChunk);
}
}  // namespace
