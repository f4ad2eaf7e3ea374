// The one instruction-set layer of splitserve's C++ CPU kernels, included by every kernel file.
// It holds which vector code a build takes, float32 vectors and their operations, horizontal sums,
// the exp approximation, and float32 vectors stored as float16 or bfloat16.
//
// The build compiles with -march=native (plus -mno-avx512f for SPLITSERVE_CPU_ISA=avx2, see
// build.py), so the code runs on the machine that compiled it. What that machine has is read here,
// once, from the compiler's macros; the kernels test only these:
//   SPLITSERVE_ISA_AVX2        AVX2 with FMA and F16C: the 256-bit code. Also defined in AVX-512
//                              builds, whose code uses the 256-bit helpers too.
//   SPLITSERVE_ISA_AVX512      AVX-512 F, BW and VL besides (cpu_features.isa()'s "avx512").
//   SPLITSERVE_HAS_AVX512BF16  AVX-512 with bfloat16 dot products and conversions (vdpbf16ps, vcvtneps2bf16).
//   SPLITSERVE_HAS_AVX512VNNI  AVX-512 with 8-bit integer dot products (vpdpbusd).
// A kernel picks its code with
//   #if defined(SPLITSERVE_ISA_AVX512) ... #elif defined(SPLITSERVE_ISA_AVX2) ... #else (plain loops,
//   which the compiler vectorises as it can) #endif.
//
// Everything here has internal linkage (an unnamed namespace), as when each kernel file kept its own
// copy: each file compiles and inlines what it uses on its own, with the same flags.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPLITSERVE_ISA_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPLITSERVE_ISA_AVX512 1
#if defined(__AVX512BF16__)
#define SPLITSERVE_HAS_AVX512BF16 1
#endif
#if defined(__AVX512VNNI__)
#define SPLITSERVE_HAS_AVX512VNNI 1
#endif
#endif
#endif

#if defined(SPLITSERVE_ISA_AVX2)
#include <immintrin.h>
#endif

namespace {

// ---- one float: the steps the exp approximation shares with the vectors below -------------------
inline float vadd(float a, float b) { return a + b; }
inline float vsub(float a, float b) { return a - b; }
inline float vmul(float a, float b) { return a * b; }
inline float vdiv(float a, float b) { return a / b; }
inline float vneg(float a) { return -a; }
inline float vexp2i(float n) {  // 2^n for integral n in [-126, 127], from the exponent bits
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float hsum(float v) { return v; }
inline float hmax(float v) { return v; }

// ---- vec: the widest float32 vector of the build (one float in plain builds), kVecWidth lanes ---
#if defined(SPLITSERVE_ISA_AVX512)
using vec = __m512;
constexpr int64_t kVecWidth = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec vneg(vec a) {  // the sign bit flipped, as unary minus does (0 - a would turn -0 into +0)
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN)));
}
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vexp2i(vec n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline vec vzero_le(vec v, vec x, float bound) {  // 0 where x <= bound, else v
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(bound), _CMP_GT_OQ), v);
}
// lanes whose index k0 + i lies in [a, z] keep v, the others take other
inline vec vin_range(vec v, int64_t k0, int64_t a, int64_t z, float other) {
  const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(k0)),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __mmask16 m = _mm512_cmp_epi32_mask(idx, _mm512_set1_epi32(static_cast<int>(a)), _MM_CMPINT_NLT) &
                      _mm512_cmp_epi32_mask(idx, _mm512_set1_epi32(static_cast<int>(z)), _MM_CMPINT_LE);
  return _mm512_mask_mov_ps(_mm512_set1_ps(other), m, v);
}
#elif defined(SPLITSERVE_ISA_AVX2)
using vec = __m256;
constexpr int64_t kVecWidth = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec vneg(vec a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.f)); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vexp2i(vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vec vzero_le(vec v, vec x, float bound) { return _mm256_and_ps(v, _mm256_cmp_ps(x, _mm256_set1_ps(bound), _CMP_GT_OQ)); }
inline vec vin_range(vec v, int64_t k0, int64_t a, int64_t z, float other) {
  const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(k0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i m = _mm256_and_si256(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(static_cast<int>(a - 1))),
                                     _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(z + 1)), idx));
  return _mm256_blendv_ps(_mm256_set1_ps(other), v, _mm256_castsi256_ps(m));
}
#else
using vec = float;  // vadd, vsub, vmul, vexp2i, hsum and hmax: the one-float ones above
constexpr int64_t kVecWidth = 1;
inline vec vzero() { return 0.f; }
inline vec vload(const float* p) { return *p; }
inline void vstore(float* p, vec v) { *p = v; }
inline vec vset1(float x) { return x; }
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
inline vec vmin(vec a, vec b) { return std::min(a, b); }
inline vec vmax(vec a, vec b) { return std::max(a, b); }
inline vec vzero_le(vec v, vec x, float bound) { return x > bound ? v : 0.f; }
inline vec vin_range(vec v, int64_t k0, int64_t a, int64_t z, float other) { return k0 >= a && k0 <= z ? v : other; }
#endif

// ---- horizontal sums and maxima -----------------------------------------------------------------
#if defined(SPLITSERVE_ISA_AVX2)
inline float hsum(__m128 v) {
  const __m128 s = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hsum(__m256 v) { return hsum(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))); }
inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// lane j of the result = the sum of the 8 lanes of v[j]: pairwise adds within each 128-bit half,
// then the two halves of every sum added together.
inline __m256 hsum_x8(const __m256* v) {
  const __m256 a01 = _mm256_hadd_ps(v[0], v[1]), a23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a45 = _mm256_hadd_ps(v[4], v[5]), a67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0123 = _mm256_hadd_ps(a01, a23), b4567 = _mm256_hadd_ps(a45, a67);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0123, b4567, 0x20), _mm256_permute2f128_ps(b0123, b4567, 0x31));
}
#endif

#if defined(SPLITSERVE_ISA_AVX512)
inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
inline float hmax(__m512 v) { return _mm512_reduce_max_ps(v); }

// lane j of the result = the sum of the 16 lanes of v[j] (a 16 x 16 transpose folded into adds).
inline __m512 hsum_x16(const __m512* v) {
  __m512 w[8], u[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of x = v[2k], y = v[2k+1]
    w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int m = 0; m < 4; ++m) {  // per 128-bit lane: the lane's sums of v[4m], v[4m+1], v[4m+2], v[4m+3]
    const __m512d a = _mm512_castps_pd(w[2 * m]), b = _mm512_castps_pd(w[2 * m + 1]);
    u[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // sum the four 128-bit lanes of each u[m] into lane m of the result
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

// ---- exp ----------------------------------------------------------------------------------------
// exp(x) for float32 without a libm call: x = n ln2 + r with |r| <= ln2 / 2 (n rounded to nearest
// through the float mantissa, |x log2 e| < 2^22), e^r from a degree-6 polynomial (relative error
// ~2e-7), 2^n from the exponent bits. x is clamped to [-87.3, 88.7] first; inputs at or below -87.3
// give 0 (e^-87.3 is the smallest normal float), -inf included. It comes in two forms, the same
// steps (exp_steps) with the same constants and roundings (-ffp-contract=off: no fused multiply-adds):
//  - exp_approx(float): plain C++, which the compiler vectorises inside the `#pragma omp simd` loops
//    that call it (SiLU, decode attention's softmax, sampling); on AVX2, which has no mask
//    registers, only because the build passes -fno-trapping-math (build.py);
//  - vexp(vec): on explicit vectors, for prefill attention's register-blocked softmax.
// They return the same bits for every float but NaN (checked over all 2^32 inputs, on the AVX-512,
// AVX2 and plain builds). For a NaN, the scalar form returns NaN and the vector form 0: std::max
// keeps a NaN where the x86 max instruction returns the bound, and the plain build's vector select
// takes 0 where the comparison fails. Making them agree there would change one kernel's results,
// so both forms stay.
constexpr float kExpLow = -87.3f, kExpHigh = 88.7f;

inline float splat(float x, float) { return x; }
#if defined(SPLITSERVE_ISA_AVX2)
inline vec splat(float x, vec) { return vset1(x); }
#endif

// e^x for x already clamped to [kExpLow, kExpHigh] (the value at kExpLow is left to the callers).
template <typename V>
inline V exp_steps(V x) {
  const V round = splat(12582912.f, x);
  const V n = vsub(vadd(vmul(x, splat(1.44269504088896341f, x)), round), round);
  const V r = vsub(vsub(x, vmul(n, splat(0.693145751953125f, x))), vmul(n, splat(1.42860682030941723e-6f, x)));
  V p = splat(1.f / 720.f, x);
  p = vadd(vmul(p, r), splat(1.f / 120.f, x));
  p = vadd(vmul(p, r), splat(1.f / 24.f, x));
  p = vadd(vmul(p, r), splat(1.f / 6.f, x));
  p = vadd(vmul(p, r), splat(0.5f, x));
  p = vadd(vmul(p, r), splat(1.f, x));
  p = vadd(vmul(p, r), splat(1.f, x));
  return vmul(p, vexp2i(n));
}

inline float exp_approx(float x) {
  x = std::min(std::max(x, kExpLow), kExpHigh);
  const float e = exp_steps(x);
  return x <= kExpLow ? 0.f : e;
}

inline vec vexp(vec x) {
  x = vmin(vmax(x, vset1(kExpLow)), vset1(kExpHigh));
  return vzero_le(exp_steps(x), x, kExpLow);
}

// ---- loads and stores ---------------------------------------------------------------------------
#if defined(SPLITSERVE_ISA_AVX2)
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// float32 lanes stored as T, rounded to nearest even as c10's conversions do (a NaN stays a NaN).
inline void store(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline void store(c10::Half* out, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
// v rounded to bfloat16 in place (the low 16 bits zero), as static_cast<c10::BFloat16> rounds.
inline __m256 vround_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256i r = _mm256_and_si256(up, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                          _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
inline void store(c10::BFloat16* out, __m256 v) {
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(vround_bf16(v)), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
#endif

#if defined(SPLITSERVE_ISA_AVX512)
inline void store(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
inline void store(c10::Half* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store(c10::BFloat16* out, __m512 v) {
#if defined(SPLITSERVE_HAS_AVX512BF16)
  // One instruction where the rounding above takes eight: gguf_mm's bfloat16 tiles (which only
  // CPUs like this one get) measured 9-29% faster with it (576 -> 3072, M = 1 to 64). It rounds to
  // nearest even too, but flushes float32 denormals to zero (a dequantized GGUF value is 0 or above
  // 2^-48: float16 scales times integer codes).
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else
  store(out, _mm512_castps512_ps256(v));
  store(out + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#endif
}
#endif

// ---- vec rows of T: widened to float32, and stored rounded exactly as static_cast<T> rounds -------
// vload_as(p): kVecWidth values of T at p as float32. vstore_as(p, v): v stored as T, rounded to
// nearest even with denormals kept and a NaN made c10's NaN: bit for bit what static_cast<T> of each
// lane gives, in every build (store() above flushes denormals in AVX512-BF16 builds, which suits
// dequantized weights but not activations). vround_as<T>(v): v rounded to T and widened back. They
// let an element-wise kernel vectorise its conversions and keep the scalar loop's exact results.
inline vec vload_as(const float* p) { return vload(p); }
inline void vstore_as(float* p, vec v) { vstore(p, v); }
#if defined(SPLITSERVE_ISA_AVX512)
inline vec vload_as(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline vec vload_as(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// v rounded to bfloat16 in place, as the 256-bit vround_bf16 above.
inline vec vround_bf16(vec v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __m512i r = _mm512_and_si512(up, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  return _mm512_castsi512_ps(
      _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000)));
}
inline void vstore_as(c10::BFloat16* p, vec v) {
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(vround_bf16(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
}
inline void vstore_as(c10::Half* p, vec v) { store(p, v); }
#elif defined(SPLITSERVE_ISA_AVX2)
inline vec vload_as(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline vec vload_as(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void vstore_as(c10::BFloat16* p, vec v) { store(p, v); }
inline void vstore_as(c10::Half* p, vec v) { store(p, v); }
#else
template <typename T>
inline vec vload_as(const T* p) { return static_cast<float>(*p); }
template <typename T>
inline void vstore_as(T* p, vec v) { *p = static_cast<T>(v); }
#endif

// The element types the three take; vectorised_part<T>(n): how much of a row of n values goes
// through them (whole vectors), 0 for other types (double), which keep the scalar loops.
template <typename T>
constexpr bool kVecAs = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;
template <typename T>
constexpr int64_t vectorised_part(int64_t n) {
  return kVecAs<T> ? n / kVecWidth * kVecWidth : 0;
}

template <typename T>
inline vec vround_as(vec v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
#if defined(SPLITSERVE_ISA_AVX2)
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return vround_bf16(v);
#endif
  } else {
    T tmp[kVecWidth];
    vstore_as(tmp, v);
    return vload_as(tmp);
  }
}

}  // namespace
