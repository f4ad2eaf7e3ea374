// splitserve's GGUF kernels: matrix products with weights kept in their GGUF (ggml) quantized
// blocks, the dequantization of such weights, and embedding lookups in them. Compiled into the same
// extension as cpu_ops.cpp (splitserve/kernels/__init__.py), with the same flags; the Python side
// is splitserve/kernels/gguf.py.
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
// gguf_mm takes one of two paths:
//  - a few rows of x (decode, memory bound): each row of x is quantized once per call to 8-bit
//    integers, a float scale per 32 values as the weights have, and each weight row is unpacked
//    once and multiplied with all the x rows in integer dot products (AVX-512 VNNI, AVX-512BW,
//    AVX2, or plain loops), scaled in float once per chunk; Q4_0 and Q4_1 weights repacked by
//    gguf_repack (16 rows interleaved, see "weights interleaved" below) take 16 rows at a time;
//  - many rows (prefill, compute bound): each thread dequantizes tiles of its weight rows into a
//    float32 or bfloat16 buffer and multiplies them into their columns of the output with at::mm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// The vector dot products: 512-bit with AVX-512BW (VNNI where present), else 256-bit with AVX2, FMA
// and F16C (whose code unpacking the AVX-512 path also uses), else plain loops.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GGUF_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define GGUF_AVX512 1
#endif
#endif

namespace {

constexpr int64_t kChunk = 32;  // values per chunk: the unit of scales and of the quantized x

// Where the few-rows path ends: gguf_mm multiplies in integers for M below these and through
// dequantized tiles from there on. Measured on SmolLM2-135M's shapes (K=576 -> N=192, 576, 3072,
// 49152; K=1536 -> N=576) with Q4_1 and Q8_0 weights, one thread of an AMD EPYC (Zen 4, AVX-512
// VNNI and BF16), both builds:
//  - bfloat16 tiles (bfloat16 x where the CPU has native bf16): the paths are within 15% of each
//    other at M = 8 on every shape, and the tiles 10-33% faster from M = 12;
//  - float32 tiles (float32 x, or no native bf16): even at M = 12 to 24 depending on the shape (12
//    for N=192, 16 for N=576, 24 for N=3072 and 49152); at 16 neither path loses more than ~20%.
constexpr int64_t kDequantizeFromRowsBf16 = 8;
constexpr int64_t kDequantizeFromRows = 16;
// The same for repacked weights (gguf_repack), whose integer path runs 2-3.9x faster at M = 1 to 4:
// on the same shapes and CPU (two threads, Q4_1, x in 4-row calls) it beat the bfloat16 tiles up to
// M = 16 on every shape and to 48 on N = 3072, and the float32 tiles at every M measured (to 48).
constexpr int64_t kRepackedDequantizeFromRowsBf16 = 24;
constexpr int64_t kRepackedDequantizeFromRows = 64;
// Bytes of dequantized weights per tile (per thread). Large, because at::mm has a fixed cost per
// call (~15 us in bfloat16 with oneDNN, ~3 us in float32): 4 MiB tiles measured 15-25% faster than
// 256 KiB ones at M = 16 and as fast at M = 256 (they are then read from L3 rather than L2).
constexpr int64_t kTileBytes = 4 << 20;

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

#if defined(GGUF_AVX2)
// ---- codes, vectors: codes<Q>(block, chunk) = the chunk's 32 codes as bytes, in value order ------
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

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

// ---- dequantized values to T, rounded to nearest even as c10's conversions do (a NaN stays a NaN)
inline void store(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline void store(c10::Half* out, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store(c10::BFloat16* out, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

#if defined(GGUF_AVX512)
inline void store(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
inline void store(c10::Half* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store(c10::BFloat16* out, __m512 v) {
#if defined(__AVX512BF16__)
  // One instruction where the rounding above takes eight: gguf_mm's bfloat16 tiles (which only
  // CPUs like this one get) measured 9-29% faster with it (576 -> 3072, M = 1 to 64). It rounds to
  // nearest even too; the float32 denormals it flushes cannot occur here (a dequantized value is 0
  // or above 2^-48: float16 scales times integer codes).
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else
  store(out, _mm512_castps512_ps256(v));
  store(out + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#endif
}

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
#if defined(GGUF_AVX2)
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


// ---- weights interleaved for decode's products ------------------------------------------------
// gguf_repack rewrites a Q4_0 or Q4_1 weight so that the few-rows path multiplies 16 output rows at
// once, one row per 32-bit lane of a 512-bit vector (two 256-bit halves on AVX2), as llama.cpp's
// repacked CPU layouts do: a code load serves 16 rows, their scales convert 16 at a time, and no
// row ends in a horizontal sum. The weight becomes [N / 16, 16 * row_bytes] bytes (as many as
// before): per group of 16 rows, per 32-value chunk, a record of 16 blocks' bytes holding
//   16 float16 d (row r's at 2r), for Q4_1 then 16 float16 m, then 256 bytes of codes: four
//   64-byte vectors, vector j holding row r's codes 8j .. 8j + 3 in the low nibbles of its bytes
//   [4r, 4r + 4) and codes 8j + 4 .. 8j + 7 in their high nibbles.
// Its type id is the ggml one plus kRepacked; gguf_mm and gguf_dequantize take both layouts.
constexpr int64_t kRepacked = 256;
constexpr int64_t kGroupRows = 16;

template <class Q>
struct Record {
  static_assert(std::is_same_v<Q, Q4_0> || std::is_same_v<Q, Q4_1>, "only Q4_0 and Q4_1 are repacked");
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
  }
  TORCH_CHECK(false, "GGUF type id ", qtype, " is not repacked here; repacked: Q4_0 (2), Q4_1 (3)");
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

// Chunk c of 16 rows (rows[r * row_bytes] onwards) into its record.
template <class Q>
void repack_record(const uint8_t* rows, int64_t row_bytes, int64_t c, uint8_t* rec) {
  uint8_t* codes = rec + Record<Q>::kCodesAt;
  for (int64_t r = 0; r < kGroupRows; ++r) {
    const uint8_t* block = rows + r * row_bytes + c * Q::kBytes;
    std::memcpy(rec + 2 * r, block, 2);
    if constexpr (Q::kHasMin) std::memcpy(rec + Record<Q>::kMinsAt + 2 * r, block + 2, 2);
    const uint8_t* qs = block + (Q::kHasMin ? 4 : 2);  // value i in the low nibble of byte i, i + 16 in its high one
    uint8_t code[kChunk];
    for (int i = 0; i < 16; ++i) code[i] = qs[i] & 15, code[i + 16] = qs[i] >> 4;
    for (int j = 0; j < 4; ++j)
      for (int b = 0; b < 4; ++b)
        codes[64 * j + 4 * r + b] = static_cast<uint8_t>(code[8 * j + b] | (code[8 * j + 4 + b] << 4));
  }
}

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

// Row r's 32 codes of a record's codes, in value order.
#if defined(GGUF_AVX2)
inline __m256i repacked_codes(const uint8_t* codes, int64_t r) {
  int32_t words[4];
  for (int j = 0; j < 4; ++j) std::memcpy(&words[j], codes + 64 * j + 4 * r, 4);
  const __m128i n = _mm_loadu_si128(reinterpret_cast<const __m128i*>(words)), low = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(n, low), hi = _mm_and_si128(_mm_srli_epi16(n, 4), low);
  // [lo 0, hi 0, lo 1, hi 1] are values 0-15 and [lo 2, hi 2, lo 3, hi 3] values 16-31
  return _mm256_set_m128i(_mm_unpackhi_epi32(lo, hi), _mm_unpacklo_epi32(lo, hi));
}
#else
inline void repacked_codes(const uint8_t* codes, int64_t r, int8_t* q) {
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
#if defined(GGUF_AVX2)
    dequantize_codes<Q>(repacked_codes(rec + Record<Q>::kCodesAt, r), Record<Q>::scales(rec, r), out + c * kChunk);
#else
    int8_t q[kChunk];
    repacked_codes(rec + Record<Q>::kCodesAt, r, q);
    dequantize_codes<Q>(q, Record<Q>::scales(rec, r), out + c * kChunk);
#endif
  }
}

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

at::Tensor gguf_embedding(const at::Tensor& ids, const at::Tensor& w, int64_t qtype, int64_t K,
                          at::ScalarType dtype) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.device().is_cpu(),
              "ids must be a contiguous [T] int64 CPU tensor");
  return with_format(qtype, [&](auto format) {
    using Q = decltype(format);
    const int64_t V = w.dim() == 2 ? w.size(0) : 0;
    check_weight<Q>(w, V, K);
    const int64_t T_ = ids.size(0), row_bytes = w.size(1);
    TORCH_CHECK(T_ == 0 || (ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < V),
                "token ids must lie in [0, ", V, ")");
    at::Tensor out = at::empty({T_, K}, w.options().dtype(dtype));
    const int64_t* id = ids.data_ptr<int64_t>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    with_dtype(dtype, [&](auto tag) {
      auto* op = out.data_ptr<decltype(tag)>();
      at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) dequantize_row<Q>(wp + id[t] * row_bytes, K, op + t * K);
      });
    });
    return out;
  });
}

// ---- few rows: integer dot products -----------------------------------------------------------
// Rows of x quantized per chunk: x ~ d * q with q in [-127, 127], d = max |x| / 127. Per 16-value
// half, its chunk's d (scale) and d * sum(q) (sum): the weight's offset and min multiply the sum.
// The chunk count is padded to even with zeros so that the vector loops can take chunks in pairs.
struct QuantizedX {
  int64_t chunks;             // per row, padded
  std::vector<int8_t> q;      // [M, chunks * 32]
  std::vector<float> scale;   // [M, chunks * 2]
  std::vector<float> sum;     // [M, chunks * 2]
  const int8_t* q_row(int64_t m) const { return q.data() + m * chunks * kChunk; }
  const float* scale_row(int64_t m) const { return scale.data() + m * chunks * 2; }
  const float* sum_row(int64_t m) const { return sum.data() + m * chunks * 2; }
};

// One chunk of x: q[0, 32) = round(v / d) with d = max |v| / 127; scale[h] = d and sum[h] = d * the
// sum of q over half h.
template <typename T>
void quantize_chunk(const T* v, int8_t* q, float* scale, float* sum) {
  float amax = 0.f;
  for (int i = 0; i < kChunk; ++i) amax = std::max(amax, std::abs(static_cast<float>(v[i])));
  const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  int sums[2] = {0, 0};
  for (int i = 0; i < kChunk; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(static_cast<float>(v[i]) * inv));
    sums[i / 16] += q[i];
  }
  for (int half = 0; half < 2; ++half) {
    scale[half] = d;
    sum[half] = d * static_cast<float>(sums[half]);
  }
}

// x [M, K] quantized, row by row (M is small on this path: no thread would earn its start-up).
template <typename T>
QuantizedX quantize_x(const T* x, int64_t M, int64_t K) {
  QuantizedX qx;
  qx.chunks = (K / kChunk + 1) / 2 * 2;
  qx.q.assign(M * qx.chunks * kChunk, 0);
  qx.scale.assign(M * qx.chunks * 2, 0.f);
  qx.sum.assign(M * qx.chunks * 2, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / kChunk; ++g) {
      const int64_t at = m * qx.chunks + g;
      quantize_chunk(x + m * K + g * kChunk, &qx.q[at * kChunk], &qx.scale[at * 2], &qx.sum[at * 2]);
    }
  return qx;
}

// What each 16-value half adds per unit of x's sum: min - offset * scale.
template <class Q>
inline float half_bias(const ChunkScales& s, float scale) {
  return s.min - static_cast<float>(Q::kOffset) * scale;
}

#if defined(GGUF_AVX2)
inline float hsum(__m128 v) {
  const __m128 s = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Chunks g and g + 1 of a weight row: their codes, and per half [g lo, g hi, g+1 lo, g+1 hi] the
// scale and the bias (what a unit of x's sum adds). A missing chunk g + 1 (K / 32 odd) is zeros.
struct ChunkPair {
  __m256i a, b;
  __m128 scales, biases;
};

template <class Q>
inline ChunkPair unpack_pair(const uint8_t* row, int64_t g, int64_t chunks) {
  constexpr int64_t per_block = Q::kValues / kChunk;
  const uint8_t* block_a = row + g / per_block * Q::kBytes;
  const uint8_t* block_b = row + (g + 1) / per_block * Q::kBytes;
  const bool has_b = g + 1 < chunks;
  const ChunkScales a = Q::scales(block_a, g % per_block);
  const ChunkScales b = has_b ? Q::scales(block_b, (g + 1) % per_block) : ChunkScales{0.f, 0.f, 0.f};
  return {codes<Q>(block_a, g % per_block),
          has_b ? codes<Q>(block_b, (g + 1) % per_block) : _mm256_setzero_si256(),
          _mm_setr_ps(a.lo, a.hi, b.lo, b.hi),
          _mm_setr_ps(half_bias<Q>(a, a.lo), half_bias<Q>(a, a.hi), half_bias<Q>(b, b.lo), half_bias<Q>(b, b.hi))};
}

// The integer dot products take unsigned bytes times signed ones (maddubs, dpbusd). Signed codes
// (Q8_0) go in as |code|, with their signs moved onto x: an offset of 128 instead would overflow
// maddubs' int16 pair sums (255 * 127 * 2), while |code| <= 128 cannot.
#if defined(GGUF_AVX512)
// 16 int32 lanes: sums of 4 products of u and s each, lanes 4h .. 4h + 3 for bytes 16h .. 16h + 15.
inline __m512i dot16(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

// A pair's 64 codes ready for dot16: unsigned, and where they were negative.
struct PairCodes {
  __m512i u;
  __mmask64 negative;
};

template <bool kSigned>
inline PairCodes prepare(const ChunkPair& p) {
  const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(p.a), p.b, 1);
  if constexpr (kSigned) return {_mm512_abs_epi8(w), _mm512_movepi8_mask(w)};
  return {w, 0};
}

// One x row's running product with a weight row, 16 lanes wide: lane l holds products of the
// chunk pairs' half l / 4, scaled by that half's weight and x scales.
struct RowDot {
  __m512 acc = _mm512_setzero_ps();
  __m128 bias = _mm_setzero_ps();

  // xq: x's codes for the pair's 64 values; xs, xsum: x's scale and sum of the pair's 4 halves.
  template <bool kSigned>
  void add(const PairCodes& w, const ChunkPair& p, const int8_t* xq, const float* xs, const float* xsum) {
    __m512i xv = _mm512_loadu_si512(xq);
    if constexpr (kSigned) xv = _mm512_mask_sub_epi8(xv, w.negative, _mm512_setzero_si512(), xv);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m128 scales = _mm_mul_ps(p.scales, _mm_loadu_ps(xs));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot16(w.u, xv)),
                          _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(scales)), acc);
    bias = _mm_fmadd_ps(p.biases, _mm_loadu_ps(xsum), bias);
  }
  float total() const { return _mm512_reduce_add_ps(acc) + hsum(bias); }
};
#else
// 8 int32 lanes: sums of 4 products of u and s each, lanes 4h .. 4h + 3 for bytes 16h .. 16h + 15.
inline __m256i dot8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// A pair's codes ready for dot8: unsigned, and (signed types) the codes whose signs x takes.
struct PairCodes {
  __m256i ua, ub, signs_a, signs_b;
};

template <bool kSigned>
inline PairCodes prepare(const ChunkPair& p) {
  if constexpr (kSigned) return {_mm256_abs_epi8(p.a), _mm256_abs_epi8(p.b), p.a, p.b};
  return {p.a, p.b, p.a, p.b};
}

// One x row's running product with a weight row, 8 lanes wide: lanes 0-3 hold products of the
// first half of a chunk, lanes 4-7 of its second half.
struct RowDot {
  __m256 acc = _mm256_setzero_ps();
  __m128 bias = _mm_setzero_ps();

  // xq: x's codes for the pair's 64 values; xs, xsum: x's scale and sum of the pair's 4 halves.
  template <bool kSigned>
  void add(const PairCodes& w, const ChunkPair& p, const int8_t* xq, const float* xs, const float* xsum) {
    __m256i xa = load256(xq), xb = load256(xq + kChunk);
    if constexpr (kSigned) xa = _mm256_sign_epi8(xa, w.signs_a), xb = _mm256_sign_epi8(xb, w.signs_b);
    const __m256 scales = _mm256_castps128_ps256(_mm_mul_ps(p.scales, _mm_loadu_ps(xs)));
    const __m256 scales_a = _mm256_permutevar8x32_ps(scales, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    const __m256 scales_b = _mm256_permutevar8x32_ps(scales, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot8(w.ua, xa)), scales_a, acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot8(w.ub, xb)), scales_b, acc);
    bias = _mm_fmadd_ps(p.biases, _mm_loadu_ps(xsum), bias);
  }
  float total() const {
    return hsum(_mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1))) + hsum(bias);
  }
};
#endif

// out[r * out_stride] = weight row . x row m0 + r for r < R: the row is unpacked once, chunk pair
// by chunk pair, for all R rows of x.
template <class Q, int R, typename T>
void dot_rows(const uint8_t* row, int64_t K, const QuantizedX& x, int64_t m0, T* out, int64_t out_stride) {
  const int64_t chunks = K / kChunk;
  RowDot dots[R];
  for (int64_t g = 0; g < chunks; g += 2) {
    const ChunkPair pair = unpack_pair<Q>(row, g, chunks);
    const PairCodes codes = prepare<Q::kSigned>(pair);
    for (int r = 0; r < R; ++r)
      dots[r].template add<Q::kSigned>(codes, pair, x.q_row(m0 + r) + g * kChunk, x.scale_row(m0 + r) + 2 * g,
                                       x.sum_row(m0 + r) + 2 * g);
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = static_cast<T>(dots[r].total());
}
#else
// out[r * out_stride] = weight row . x row m0 + r for r < R, chunk by chunk.
template <class Q, int R, typename T>
void dot_rows(const uint8_t* row, int64_t K, const QuantizedX& x, int64_t m0, T* out, int64_t out_stride) {
  constexpr int64_t per_block = Q::kValues / kChunk;
  float total[R] = {};
  for (int64_t g = 0; g < K / kChunk; ++g) {
    const uint8_t* block = row + g / per_block * Q::kBytes;
    const ChunkScales s = Q::scales(block, g % per_block);
    int8_t w[kChunk];
    codes<Q>(block, g % per_block, w);
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = x.q_row(m0 + r) + g * kChunk;
      int dot[2] = {0, 0};
      for (int i = 0; i < kChunk; ++i) dot[i / 16] += static_cast<int>(w[i]) * xq[i];
      const float* xs = x.scale_row(m0 + r) + 2 * g;
      const float* sum = x.sum_row(m0 + r) + 2 * g;
      total[r] += xs[0] * s.lo * static_cast<float>(dot[0]) + xs[1] * s.hi * static_cast<float>(dot[1]) +
                  half_bias<Q>(s, s.lo) * sum[0] + half_bias<Q>(s, s.hi) * sum[1];
    }
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = static_cast<T>(total[r]);
}
#endif

#if defined(GGUF_AVX2)
// One x row (single-stream decode) against two weight rows at once: each row's sums are computed in
// the same order as dot_rows<Q, 1> computes them (same results), but the loop carries two independent
// chains of dependent FMAs instead of one and reads x's codes once for both rows. Measured on one
// thread (AMD EPYC, AVX-512 VNNI), 576 x 1536 to 16384 x 576: 5-12% faster for Q4_0, Q4_1, Q5_0 and
// Q5_1; Q8_0 up to 20% slower on the large matrix (its 32-byte codes), and the K-quants unmeasured,
// so those keep one row at a time.
template <class Q>
constexpr bool kTwoWeightRows = std::is_same_v<Q, Q4_0> || std::is_same_v<Q, Q4_1> || std::is_same_v<Q, Q5_0> ||
                                std::is_same_v<Q, Q5_1>;

template <class Q, typename T>
void dot_two_weight_rows(const uint8_t* row0, const uint8_t* row1, int64_t K, const QuantizedX& x, T* out) {
  const int64_t chunks = K / kChunk;
  const int8_t* xq = x.q_row(0);
  const float* xs = x.scale_row(0);
  const float* xsum = x.sum_row(0);
  RowDot dot0, dot1;
  for (int64_t g = 0; g < chunks; g += 2) {
    const ChunkPair p0 = unpack_pair<Q>(row0, g, chunks), p1 = unpack_pair<Q>(row1, g, chunks);
    dot0.template add<Q::kSigned>(prepare<Q::kSigned>(p0), p0, xq + g * kChunk, xs + 2 * g, xsum + 2 * g);
    dot1.template add<Q::kSigned>(prepare<Q::kSigned>(p1), p1, xq + g * kChunk, xs + 2 * g, xsum + 2 * g);
  }
  out[0] = static_cast<T>(dot0.total());
  out[1] = static_cast<T>(dot1.total());
}
#endif

// fn(std::integral_constant<int, R>{}, m0) for the x rows [m0, m0 + R) of M, in passes of up to 4 rows:
// the integer paths' dot products are templates on R, so that their accumulators stay in registers.
template <typename Fn>
inline void in_passes_of_x_rows(int64_t M, Fn&& fn) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    switch (std::min<int64_t>(4, M - m0)) {
      case 4: fn(std::integral_constant<int, 4>{}, m0); break;
      case 3: fn(std::integral_constant<int, 3>{}, m0); break;
      case 2: fn(std::integral_constant<int, 2>{}, m0); break;
      default: fn(std::integral_constant<int, 1>{}, m0); break;
    }
  }
}

template <class Q, typename T>
void mm_integer(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K, at::Tensor& out) {
  const int64_t M = x.size(0), row_bytes = w.size(1);
  const QuantizedX qx = quantize_x(x.data_ptr<T>(), M, K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
#if defined(GGUF_AVX2)
    if (kTwoWeightRows<Q> && M == 1) {
      for (; begin + 1 < end; begin += 2)
        dot_two_weight_rows<Q, T>(wp + begin * row_bytes, wp + (begin + 1) * row_bytes, K, qx, op + begin);
    }
#endif
    for (int64_t n = begin; n < end; ++n) {
      in_passes_of_x_rows(M, [&](auto rows, int64_t m0) {
        dot_rows<Q, decltype(rows)::value>(wp + n * row_bytes, K, qx, m0, op + m0 * N + n, N);
      });
    }
  });
}

// ---- few rows, repacked weights: 16 weight rows per vector -----------------------------------------
// out[r * out_stride + i] = weight row 16 g + i . x row m0 + r for i < 16, r < R, from group g's
// records. Per chunk, lane i sums code * xq over the chunk in integers (each 4-code lane of the
// codes against x's 4 codes broadcast), then adds d * (xd * sum - offset * xsum) [+ m * xsum]
// with xd x's scale of the chunk and xsum = xd * the sum of its codes.
inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

#if defined(GGUF_AVX512)
// lane l += the dot product of u's 4 unsigned bytes and s's 4 signed ones in lane l
inline __m512i dot_add(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

template <class Q, int R, typename T>
void dot_group(const uint8_t* group, int64_t chunks, const QuantizedX& x, int64_t m0, T* out, int64_t out_stride) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* rec = group + c * Record<Q>::kBytes;
    const uint8_t* codes = rec + Record<Q>::kCodesAt;
    __m512i lo_sum[R], hi_sum[R];  // two chains of dependent dot products rather than one
    for (int r = 0; r < R; ++r) lo_sum[r] = hi_sum[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(codes + 64 * j);
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q_row(m0 + r) + c * kChunk + 8 * j;
        lo_sum[r] = dot_add(lo_sum[r], lo, _mm512_set1_epi32(load_i32(xq)));
        hi_sum[r] = dot_add(hi_sum[r], hi, _mm512_set1_epi32(load_i32(xq + 4)));
      }
    }
    const __m512 d = _mm512_cvtph_ps(load256(rec));
    for (int r = 0; r < R; ++r) {
      const float xd = x.scale_row(m0 + r)[2 * c];
      const float xsum = x.sum_row(m0 + r)[2 * c] + x.sum_row(m0 + r)[2 * c + 1];
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(lo_sum[r], hi_sum[r]));
      const __m512 dot = _mm512_fmadd_ps(sum, _mm512_set1_ps(xd), _mm512_set1_ps(-static_cast<float>(Q::kOffset) * xsum));
      acc[r] = _mm512_fmadd_ps(d, dot, acc[r]);
      if constexpr (Q::kHasMin)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(load256(rec + Record<Q>::kMinsAt)), _mm512_set1_ps(xsum), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store(out + r * out_stride, acc[r]);
}
#elif defined(GGUF_AVX2)
// Two 8-row halves per group. maddubs' int16 pair sums are added up in int16 over the whole chunk:
// 4-bit codes times |xq| <= 127 keep the 16 pairs of a lane within 16 * 15 * 127 = 30480.
template <class Q, int R, typename T>
void dot_group(const uint8_t* group, int64_t chunks, const QuantizedX& x, int64_t m0, T* out, int64_t out_stride) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* rec = group + c * Record<Q>::kBytes;
    const uint8_t* codes = rec + Record<Q>::kCodesAt;
    __m256i sums[R][2];
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      for (int h = 0; h < 2; ++h) {
        const __m256i v = load256(codes + 64 * j + 32 * h);
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x.q_row(m0 + r) + c * kChunk + 8 * j;
          sums[r][h] = _mm256_add_epi16(sums[r][h], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xq))));
          sums[r][h] = _mm256_add_epi16(sums[r][h], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(xq + 4))));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * h)));
      for (int r = 0; r < R; ++r) {
        const float xd = x.scale_row(m0 + r)[2 * c];
        const float xsum = x.sum_row(m0 + r)[2 * c] + x.sum_row(m0 + r)[2 * c + 1];
        const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r][h], ones));
        const __m256 dot =
            _mm256_fmadd_ps(sum, _mm256_set1_ps(xd), _mm256_set1_ps(-static_cast<float>(Q::kOffset) * xsum));
        acc[r][h] = _mm256_fmadd_ps(d, dot, acc[r][h]);
        if constexpr (Q::kHasMin) {
          const auto* mins = reinterpret_cast<const __m128i*>(rec + Record<Q>::kMinsAt + 16 * h);
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(mins)), _mm256_set1_ps(xsum), acc[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) store(out + r * out_stride + 8 * h, acc[r][h]);
}
#else
template <class Q, int R, typename T>
void dot_group(const uint8_t* group, int64_t chunks, const QuantizedX& x, int64_t m0, T* out, int64_t out_stride) {
  for (int64_t i = 0; i < kGroupRows; ++i) {
    float total[R] = {};
    for (int64_t c = 0; c < chunks; ++c) {
      const uint8_t* rec = group + c * Record<Q>::kBytes;
      const ChunkScales s = Record<Q>::scales(rec, i);
      int8_t w[kChunk];
      repacked_codes(rec + Record<Q>::kCodesAt, i, w);
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q_row(m0 + r) + c * kChunk;
        int sum = 0;
        for (int v = 0; v < kChunk; ++v) sum += static_cast<int>(w[v]) * xq[v];
        const float xd = x.scale_row(m0 + r)[2 * c];
        const float xsum = x.sum_row(m0 + r)[2 * c] + x.sum_row(m0 + r)[2 * c + 1];
        total[r] += s.lo * (xd * static_cast<float>(sum) - static_cast<float>(Q::kOffset) * xsum) + s.min * xsum;
      }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride + i] = static_cast<T>(total[r]);
  }
}
#endif

template <class Q, typename T>
void mm_integer_repacked(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K, at::Tensor& out) {
  const int64_t M = x.size(0), chunks = K / kChunk, group_bytes = w.size(1);
  const QuantizedX qx = quantize_x(x.data_ptr<T>(), M, K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N / kGroupRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      in_passes_of_x_rows(M, [&](auto rows, int64_t m0) {
        dot_group<Q, decltype(rows)::value>(wp + g * group_bytes, chunks, qx, m0, op + m0 * N + g * kGroupRows, N);
      });
    }
  });
}

// ---- many rows: dequantized tiles and at::mm ----------------------------------------------------
// Each thread takes its share of the weight rows, tile by tile: it dequantizes the tile into its own
// buffer of T and multiplies it into the tile's columns of out with at::mm (single-threaded inside
// the parallel region). One parallel region per call: a barrier per tile costs a scheduler time
// slice whenever another process holds a core. Shares and tiles are whole multiples of 64 rows:
// MKL's float32 GEMM ran 15% slower on 1820-row tiles than on 1792-row ones (M = 2048, K = 576).
// dequantize(n, out) writes weight row n into out[0, K).
template <typename T, typename Dequantize>
void mm_tiles(const at::Tensor& x, Dequantize dequantize, int64_t N, int64_t K, at::Tensor& out) {
  constexpr int64_t kRows = 64;
  const int64_t tile_rows = std::max<int64_t>(1, kTileBytes / (K * static_cast<int64_t>(sizeof(T))) / kRows) * kRows;
  // at::mm_out writes into out: the worker threads must share the caller's inference mode, or torch
  // refuses to update an inference tensor (the engine runs the model under torch.inference_mode).
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, (N + kRows - 1) / kRows, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard(inference);
    const int64_t first = begin * kRows, last = std::min(N, end * kRows);
    at::Tensor tile = at::empty({std::min(tile_rows, last - first), K}, x.options());
    for (int64_t n0 = first; n0 < last; n0 += tile_rows) {
      const int64_t rows = std::min(tile_rows, last - n0);
      for (int64_t n = 0; n < rows; ++n) dequantize(n0 + n, tile.data_ptr<T>() + n * K);
      at::Tensor cols = out.narrow(1, n0, rows);
      at::mm_out(cols, x, tile.narrow(0, 0, rows).t());
    }
  });
}

// The tiles and the product are bfloat16 where x is bfloat16 and the CPU multiplies bfloat16
// natively (native_bf16, passed from splitserve.kernels.cpu_features), else float32.
template <class Q, bool kIsRepacked>
at::Tensor mm_dequantized(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K, bool bf16) {
  const at::Tensor xt = x.to(bf16 ? at::kBFloat16 : at::kFloat);
  at::Tensor out = at::empty({x.size(0), N}, xt.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    if constexpr (kIsRepacked)
      mm_tiles<T>(xt, [&](int64_t n, T* row) { dequantize_repacked_row<Q>(wp, n, K, row); }, N, K, out);
    else
      mm_tiles<T>(xt, [&](int64_t n, T* row) { dequantize_row<Q>(wp + n * w.size(1), K, row); }, N, K, out);
  };
  if (bf16)
    run(c10::BFloat16{});
  else
    run(float{});
  return out.to(x.scalar_type());
}

// x @ W.T for a weight of format Q in the block layout or repacked: integers for a few rows of x,
// dequantized tiles from the layout's threshold on.
template <class Q, bool kIsRepacked>
at::Tensor mm(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K, bool native_bf16) {
  const bool bf16_tiles = x.scalar_type() == at::kBFloat16 && native_bf16;
  const int64_t from = kIsRepacked ? (bf16_tiles ? kRepackedDequantizeFromRowsBf16 : kRepackedDequantizeFromRows)
                                   : (bf16_tiles ? kDequantizeFromRowsBf16 : kDequantizeFromRows);
  if (x.size(0) >= from) return mm_dequantized<Q, kIsRepacked>(x, w, N, K, bf16_tiles);
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    if constexpr (kIsRepacked)
      mm_integer_repacked<Q, T>(x, w, N, K, out);
    else
      mm_integer<Q, T>(x, w, N, K, out);
  };
  if (x.scalar_type() == at::kBFloat16)
    run(c10::BFloat16{});
  else
    run(float{});
  return out;
}

at::Tensor gguf_mm(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t N, int64_t K, bool native_bf16) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, K] with K = ", K, ", got ", x.sizes());
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 CPU tensor, got ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  if (qtype >= kRepacked) {
    return with_repackable_format(qtype - kRepacked, [&](auto format) {
      using Q = decltype(format);
      check_repacked_weight<Q>(w, N, K);
      return mm<Q, true>(x, w, N, K, native_bf16);
    });
  }
  return with_format(qtype, [&](auto format) {
    using Q = decltype(format);
    check_weight<Q>(w, N, K);
    return mm<Q, false>(x, w, N, K, native_bf16);
  });
}

}  // namespace

at::Tensor splitserve::gguf_mm(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t N, int64_t K,
                               bool native_bf16) {
  return ::gguf_mm(x, w, qtype, N, K, native_bf16);
}

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("gguf_mm(Tensor x, Tensor w, int qtype, int N, int K, bool native_bf16=False) -> Tensor", &gguf_mm);
  m.def("gguf_dequantize(Tensor w, int qtype, int N, int K, ScalarType dtype) -> Tensor", &gguf_dequantize);
  m.def("gguf_repack(Tensor w, int qtype, int N, int K) -> Tensor", &gguf_repack);
  m.def("gguf_embedding(Tensor ids, Tensor w, int qtype, int K, ScalarType dtype) -> Tensor", &gguf_embedding);
}
