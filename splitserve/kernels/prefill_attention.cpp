// Prompt attention on the CPU: the new tokens of every prefill request of a step (a whole prompt or
// a chunk of one), causal over the request's cached context plus the chunk, read in place from the
// paged KV cache after the step's K/V were written to it. One call per layer for all the prefill
// requests of the step, which replaces one SDPA call per request and handles cached context
// (chunked prefill, prefix-cache hits) and sliding windows the same way.
//
// Work items are (request, KV head, tile of kTileQ query tokens); a thread takes the next item
// from a shared counter, longest first, so that one long prompt does not leave a thread idle. An
// item computes, for its kTileQ x G query rows (G query heads share a KV head):
//   S = Q K^T over the keys the tile can see, in float32;
//   P = exp(scale S - max) per row, zero outside the row's causal (and window) range;
//   O = P V / sum(P).
// K is packed transposed and V row-wise into per-thread buffers once per item, so that the inner
// loops are register-blocked outer products (RB rows x a few vectors of keys or head dimensions):
//  - bfloat16 on a CPU with AVX512-BF16: pairs of bfloat16 values multiplied by vdpbf16ps
//    (K^T as [D/2][keys] words of two dimensions, V as [keys/2][D] words of two keys), P rounded
//    to bfloat16 for P V;
//  - everything else (float32, float16, bfloat16 on AVX2 or AVX-512 without BF16): float32 FMAs
//    on AVX-512 or AVX2 vectors, plain loops elsewhere.
// Or the same buffers are the operands of oneDNN's block kernels (at::native::cpublas::brgemm,
// products_brgemm), as set by set_prompt_attention_brgemm: their float32 kernels beat the FMA loops
// on AVX2 and AVX-512 alike, and their bfloat16 kernels run on AMX tiles where the CPU has them
// (without AMX, on AVX512-BF16, they are slower than the vdpbf16ps loops for short prompts).
// Head dims are zero-padded to a multiple of 32 and keys to a multiple of 32 in the buffers (of
// kBN in the block kernels).
// Registered in ops_registry.cpp.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include "cpu_ops.h"
#include "cpu_simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTileQ = 64;  // query tokens per work item
constexpr int64_t kPad = 32;    // keys and head dims are padded to a multiple of this
constexpr int kRB = 4;          // query rows per register block
constexpr int64_t kBM = 64;     // query rows per oneDNN block product (the brgemm path)
constexpr int64_t kBN = 64;     // keys per oneDNN block product; keys are padded to it there

// Which products go through oneDNN's block kernels (set_prompt_attention_brgemm): float32 ones
// (the float buffers: float32, float16, bfloat16 without AVX512-BF16) and bfloat16 pairs.
std::atomic<bool> g_brgemm_f32{false}, g_brgemm_bf16{false};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Vectors of head dims per P V register block: 4 x 16 on AVX-512 (16 accumulators of 32
// registers), 2 x 8 on AVX2 (8 of 16).
constexpr int kNC = kVecWidth == 16 ? 4 : 2;

// One work item's shapes: rows = query tokens x G heads, keys [lo, lo + n) of its request.
struct Item {
  int64_t req, head, t0, tn, lo, n;
};

struct Shape {
  int64_t G, D, Dp, npad;  // Dp, npad: D and n padded to kPad
};

// S[r][k0, k0 + 2 kVecWidth) = Q[r] . Kt[:, k] for RB rows (float32; Q [rows][Dp], Kt [Dp][npad]).
template <int RB>
inline void scores_f32(const float* Q, const float* Kt, const Shape& s, int64_t k0, float* S) {
  vec acc[RB][2];
  for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = vzero();
  for (int64_t d = 0; d < s.Dp; ++d) {
    const vec lo = vload(Kt + d * s.npad + k0), hi = vload(Kt + d * s.npad + k0 + kVecWidth);
    for (int r = 0; r < RB; ++r) {
      const vec qb = vset1(Q[r * s.Dp + d]);
      acc[r][0] = vfma(qb, lo, acc[r][0]);
      acc[r][1] = vfma(qb, hi, acc[r][1]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    vstore(S + r * s.npad + k0, acc[r][0]);
    vstore(S + r * s.npad + k0 + kVecWidth, acc[r][1]);
  }
}

// O[r][c0 kVecWidth, (c0 + NC) kVecWidth) = sum_{k < kend} P[r][k] V[k] for RB rows (float32; V [npad][Dp]).
template <int RB, int NC>
inline void values_f32(const float* P, const float* V, const Shape& s, int64_t kend, int64_t c0, float* O) {
  vec acc[RB][NC];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = vzero();
  for (int64_t k = 0; k < kend; ++k) {
    vec v[NC];
    for (int c = 0; c < NC; ++c) v[c] = vload(V + k * s.Dp + (c0 + c) * kVecWidth);
    for (int r = 0; r < RB; ++r) {
      const vec pb = vset1(P[r * s.npad + k]);
      for (int c = 0; c < NC; ++c) acc[r][c] = vfma(pb, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) vstore(O + r * s.Dp + (c0 + c) * kVecWidth, acc[r][c]);
}

#if defined(SPLITSERVE_HAS_AVX512BF16)
// The same two products on pairs of bfloat16 values (words of two): Qw [rows][Dp/2] and
// Kp [Dp/2][npad] pair up head dims; Pw [rows][npad/2] and Vp [npad/2][Dp] pair up keys.
template <int RB>
inline void scores_bf16(const uint32_t* Qw, const uint32_t* Kp, const Shape& s, int64_t k0, float* S) {
  __m512 acc[RB][2];
  for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t Dh = s.Dp / 2;
  for (int64_t d = 0; d < Dh; ++d) {
    const __m512bh lo = (__m512bh)_mm512_loadu_si512(Kp + d * s.npad + k0);
    const __m512bh hi = (__m512bh)_mm512_loadu_si512(Kp + d * s.npad + k0 + 16);
    for (int r = 0; r < RB; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(Qw[r * Dh + d]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, lo);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, hi);
    }
  }
  for (int r = 0; r < RB; ++r) {
    _mm512_storeu_ps(S + r * s.npad + k0, acc[r][0]);
    _mm512_storeu_ps(S + r * s.npad + k0 + 16, acc[r][1]);
  }
}

template <int RB, int NC>
inline void values_bf16(const uint32_t* Pw, const uint32_t* Vp, const Shape& s, int64_t kend, int64_t c0, float* O) {
  __m512 acc[RB][NC];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t half = s.npad / 2;
  for (int64_t k = 0; k < (kend + 1) / 2; ++k) {
    __m512bh v[NC];
    for (int c = 0; c < NC; ++c) v[c] = (__m512bh)_mm512_loadu_si512(Vp + k * s.Dp + (c0 + c) * 16);
    for (int r = 0; r < RB; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(Pw[r * half + k]));
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, v[c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(O + r * s.Dp + (c0 + c) * 16, acc[r][c]);
}
#endif

// fn.template operator()<RB>() for a run-time rb in [1, kRB]: register blocks of the last rows.
template <typename Fn>
inline void with_rows(int64_t rb, Fn&& fn) {
  switch (rb) {
    case 1: return fn.template operator()<1>();
    case 2: return fn.template operator()<2>();
    case 3: return fn.template operator()<3>();
    default: return fn.template operator()<kRB>();
  }
}

template <int RB, typename Fn>
inline void with_cols(int64_t nc, Fn&& fn) {
  switch (nc) {
    case 1: return fn.template operator()<RB, 1>();
    case 2: return fn.template operator()<RB, 2>();
    case 3: return fn.template operator()<RB, 3>();
    default: return fn.template operator()<RB, 4>();
  }
}

template <typename T>
struct Kernel {
  // inputs
  const T* q;
  int64_t q_token_stride, q_head_stride;
  T* out;
  int64_t Hq;
  const T* k_cache;
  const T* v_cache;
  int64_t head_stride, block_stride, bs;
  const int32_t* tables;
  int64_t table_stride;
  const int32_t* seq_lens;
  const int64_t* qsl;
  float scale;
  int64_t window;
  Shape shape;
  bool bf16_dot;  // the AVX512-BF16 path
  bool brgemm;    // the products through oneDNN's block kernels (products_brgemm)

  const T* row(const T* cache, int64_t req, int64_t head, int64_t token) const {
    const int32_t block = tables[req * table_stride + token / bs];
    return cache + head * head_stride + block * block_stride + (token % bs) * shape.D;
  }

  // Per-thread buffers, sized for the largest item.
  struct Scratch {
    std::vector<float> q, k, v, s, o, inv_sum;
    std::vector<uint16_t> p;  // bfloat16 probabilities (the BF16 path)
    explicit Scratch(int64_t rows, const Shape& s)
        : q(rows * s.Dp), k(s.Dp * s.npad), v(s.npad * s.Dp), s(rows * s.npad), o(rows * s.Dp), inv_sum(rows),
          p(rows * s.npad) {}
  };

  void run(const Item& it, Scratch& b) const {
    const int64_t G = shape.G, D = shape.D, Dp = shape.Dp;
    Shape s = shape;
    s.npad = round_up(it.n, kPad);
    const int64_t rows = it.tn * G;
    const int64_t qlen = qsl[it.req + 1] - qsl[it.req];
    const int64_t ctx = seq_lens[it.req] - qlen;
    if (brgemm) s.npad = round_up(it.n, kBN);
    pack(it, s, b);
    // the keys each row sees, relative to it.lo: [first_key(r), last_key(r)]
    auto last_key = [&](int64_t r) { return ctx + it.t0 + r / G - it.lo; };
    auto first_key = [&](int64_t r) {
      return window > 0 ? std::max<int64_t>(0, ctx + it.t0 + r / G - window + 1 - it.lo) : int64_t{0};
    };
    if (brgemm) {
      products_brgemm(s, rows, b, last_key, first_key);
      finish(it, rows, b);
      return;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kRB) {
      const int64_t rb = std::min<int64_t>(kRB, rows - r0);
      const int64_t kend = round_up(last_key(r0 + rb - 1) + 1, kPad);  // a multiple of every step below
      with_rows(rb, [&]<int RB>() {
        for (int64_t k0 = 0; k0 < std::min(kend, s.npad); k0 += (bf16_dot ? 32 : 2 * kVecWidth)) {
#if defined(SPLITSERVE_HAS_AVX512BF16)
          if (bf16_dot) {
            scores_bf16<RB>(reinterpret_cast<const uint32_t*>(b.q.data()) + r0 * Dp / 2,
                            reinterpret_cast<const uint32_t*>(b.k.data()), s, k0, b.s.data() + r0 * s.npad);
            continue;
          }
#endif
          scores_f32<RB>(b.q.data() + r0 * Dp, b.k.data(), s, k0, b.s.data() + r0 * s.npad);
        }
      });
      for (int64_t r = r0; r < r0 + rb; ++r) softmax_row(b, s, r, first_key(r), last_key(r), std::min(kend, s.npad));
      const int64_t vend = last_key(r0 + rb - 1) + 1;
      with_rows(rb, [&]<int RB>() {
        const int64_t step = bf16_dot ? 16 : kVecWidth, vectors = Dp / step;
        for (int64_t c0 = 0; c0 < vectors; c0 += kNC) {
          with_cols<RB>(std::min<int64_t>(kNC, vectors - c0), [&]<int RB_, int NC>() {
#if defined(SPLITSERVE_HAS_AVX512BF16)
            if (bf16_dot) {
              values_bf16<RB_, NC>(reinterpret_cast<const uint32_t*>(b.p.data()) + r0 * s.npad / 2,
                                   reinterpret_cast<const uint32_t*>(b.v.data()), s, vend, c0,
                                   b.o.data() + r0 * Dp);
              return;
            }
#endif
            values_f32<RB_, NC>(b.s.data() + r0 * s.npad, b.v.data(), s, vend, c0, b.o.data() + r0 * Dp);
          });
        }
      });
    }
    finish(it, rows, b);
  }

  // Both products of the item by oneDNN's block kernels (at::native::cpublas::brgemm), kBM rows at
  // a time over blocks of kBN keys, so that oneDNN compiles a few kernel shapes once; the softmax
  // between them is the vector path's. The buffers pack() wrote are the operands it takes: Q
  // [rows][Dp] is A; K^T [Dp][npad] and V [npad][Dp] are B, in bfloat16 as pairs of rows
  // interleaved ([Dp/2][npad][2] and [npad/2][Dp][2]: oneDNN's VNNI layout) with P in bfloat16, in
  // float32 plain with P in place of S.
  template <typename LastKey, typename FirstKey>
  void products_brgemm(const Shape& s, int64_t rows, Scratch& b, LastKey last_key, FirstKey first_key) const {
    if (bf16_dot) {
      using BF = at::BFloat16;
      blocks(s, rows, b, last_key, first_key, reinterpret_cast<const BF*>(b.q.data()),
             reinterpret_cast<const BF*>(b.k.data()), reinterpret_cast<const BF*>(b.v.data()),
             reinterpret_cast<const BF*>(b.p.data()));
    } else {
      blocks(s, rows, b, last_key, first_key, b.q.data(), b.k.data(), b.v.data(), b.s.data());
    }
  }

  // E: bfloat16 (B operands VNNI-packed, two rows per pair) or float32 (plain).
  template <typename E, typename LastKey, typename FirstKey>
  void blocks(const Shape& s, int64_t rows, Scratch& b, LastKey last_key, FirstKey first_key, const E* Q, const E* K,
              const E* V, const E* P) const {
    const int64_t Dp = s.Dp;
    constexpr bool vnni = std::is_same_v<E, at::BFloat16>;
    constexpr int64_t pair = vnni ? 2 : 1;
    for (int64_t r0 = 0; r0 < rows; r0 += kBM) {
      const int64_t rb = std::min(kBM, rows - r0);
      const int64_t kend = std::min(round_up(last_key(r0 + rb - 1) + 1, kBN), s.npad);
      float* S = b.s.data() + r0 * s.npad;
      for (int64_t k0 = 0; k0 < kend; k0 += kBN)
        at::native::cpublas::brgemm(rb, kBN, Dp, Dp, s.npad, s.npad, false, Q + r0 * Dp, K + pair * k0, S + k0, vnni);
      for (int64_t r = r0; r < r0 + rb; ++r) softmax_row(b, s, r, first_key(r), last_key(r), kend);
      float* O = b.o.data() + r0 * Dp;
      for (int64_t k0 = 0; k0 < kend; k0 += kBN)
        at::native::cpublas::brgemm(rb, Dp, kBN, s.npad, Dp, Dp, k0 > 0, P + r0 * s.npad + k0, V + k0 * Dp, O, vnni);
    }
  }

  // O / sum(P) of the item's rows into their rows of out.
  void finish(const Item& it, int64_t rows, Scratch& b) const {
    const int64_t G = shape.G, D = shape.D, Dp = shape.Dp;
    for (int64_t r = 0; r < rows; ++r) {
      T* dst = out + (qsl[it.req] + it.t0 + r / G) * Hq * D + (it.head * G + r % G) * D;
      const float* o = b.o.data() + r * Dp;
      const float w = b.inv_sum[r];
      int64_t d = 0;
#if defined(SPLITSERVE_HAS_AVX512BF16)
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        for (; d + 16 <= D; d += 16)
          store(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(w)));
#endif
      for (; d < D; ++d) dst[d] = static_cast<T>(o[d] * w);
    }
  }

  // The item's Q rows, K^T and V into the buffers: as float32, or as bfloat16 pairs in the BF16
  // path (the float buffers then hold 16-bit values and 32-bit words).
  void pack(const Item& it, const Shape& s, Scratch& b) const {
    const int64_t G = s.G, D = s.D, Dp = s.Dp;
    const int64_t base = qsl[it.req] + it.t0;
#if defined(SPLITSERVE_HAS_AVX512BF16)
    if (bf16_dot) {
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        uint16_t* qb = reinterpret_cast<uint16_t*>(b.q.data());
        for (int64_t t = 0; t < it.tn; ++t)
          for (int64_t g = 0; g < G; ++g) {
            uint16_t* dst = qb + (t * G + g) * Dp;
            std::memcpy(dst, q + (base + t) * q_token_stride + (it.head * G + g) * q_head_stride, D * sizeof(T));
            std::memset(dst + D, 0, (Dp - D) * sizeof(uint16_t));
          }
        uint32_t* kp = reinterpret_cast<uint32_t*>(b.k.data());
        const int64_t Dh = Dp / 2;
        std::memset(kp, 0, Dh * s.npad * sizeof(uint32_t));
        for (int64_t j = 0; j < it.n; ++j) {
          const uint32_t* src = reinterpret_cast<const uint32_t*>(row(k_cache, it.req, it.head, it.lo + j));
          for (int64_t d = 0; d < D / 2; ++d) kp[d * s.npad + j] = src[d];
        }
        uint32_t* vp = reinterpret_cast<uint32_t*>(b.v.data());
        for (int64_t j = 0; j < s.npad / 2; ++j) {
          const int64_t a = 2 * j, c = 2 * j + 1;
          const uint16_t* va = a < it.n ? reinterpret_cast<const uint16_t*>(row(v_cache, it.req, it.head, it.lo + a)) : nullptr;
          const uint16_t* vc = c < it.n ? reinterpret_cast<const uint16_t*>(row(v_cache, it.req, it.head, it.lo + c)) : nullptr;
          uint32_t* dst = vp + j * Dp;
          for (int64_t d = 0; d < D; ++d)
            dst[d] = (va ? uint32_t{va[d]} : 0u) | ((vc ? uint32_t{vc[d]} : 0u) << 16);
          for (int64_t d = D; d < Dp; ++d) dst[d] = 0;
        }
        return;
      }
    }
#endif
    for (int64_t t = 0; t < it.tn; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const T* src = q + (base + t) * q_token_stride + (it.head * G + g) * q_head_stride;
        float* dst = b.q.data() + (t * G + g) * Dp;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
        std::fill(dst + D, dst + Dp, 0.f);
      }
    std::fill(b.k.begin(), b.k.begin() + Dp * s.npad, 0.f);
    std::fill(b.v.begin(), b.v.begin() + s.npad * Dp, 0.f);
    for (int64_t j = 0; j < it.n; ++j) {
      const T* kr = row(k_cache, it.req, it.head, it.lo + j);
      const T* vr = row(v_cache, it.req, it.head, it.lo + j);
      for (int64_t d = 0; d < D; ++d) b.k[d * s.npad + j] = static_cast<float>(kr[d]);
      for (int64_t d = 0; d < D; ++d) b.v[j * Dp + d] = static_cast<float>(vr[d]);
    }
  }

  // Row r of S into probabilities over keys [a, z], unnormalised, and zeros elsewhere up to end (the
  // keys its register block multiplies); 1 / their sum into inv_sum[r].
  void softmax_row(Scratch& b, const Shape& s, int64_t r, int64_t a, int64_t z, int64_t end) const {
    // In whole vectors over the (padded) range, the row's keys selected by lane: no scalar tails.
    float* row_s = b.s.data() + r * s.npad;
    vec m = vset1(-INFINITY);
    for (int64_t k = 0; k < end; k += kVecWidth) m = vmax(m, vin_range(vload(row_s + k), k, a, z, -INFINITY));
    const vec sc = vset1(scale), shift = vset1(hmax(m) * scale);
    vec total = vzero();
    for (int64_t k = 0; k < end; k += kVecWidth) {
      const vec e = vin_range(vexp(vsub(vmul(vload(row_s + k), sc), shift)), k, a, z, 0.f);
      vstore(row_s + k, e);
      total = vadd(total, e);
    }
    const float sum = hsum(total);
    b.inv_sum[r] = 1.f / sum;
#if defined(SPLITSERVE_HAS_AVX512BF16)
    if (bf16_dot) {  // P V multiplies bfloat16 probabilities (both paths)
      uint16_t* p = b.p.data() + r * s.npad;
      for (int64_t k = 0; k < end; k += 16)
        store(reinterpret_cast<c10::BFloat16*>(p + k), _mm512_loadu_ps(row_s + k));
    }
#endif
  }
};

template <typename T>
void prefill_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& qsl_t,
                            int64_t first, double scale, int64_t window) {
  const int64_t R = seq_lens.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(0);
  const int64_t G = Hq / Hkv;
  Kernel<T> kern{};
  kern.q = q.data_ptr<T>();
  kern.q_token_stride = q.stride(0);
  kern.q_head_stride = q.stride(1);
  kern.out = out.data_ptr<T>();
  kern.Hq = Hq;
  kern.k_cache = k_cache.data_ptr<T>();
  kern.v_cache = v_cache.data_ptr<T>();
  kern.head_stride = k_cache.stride(0);
  kern.block_stride = k_cache.stride(1);
  kern.bs = k_cache.size(2);
  kern.tables = block_tables.data_ptr<int32_t>();
  kern.table_stride = block_tables.stride(0);
  kern.seq_lens = seq_lens.data_ptr<int32_t>();
  kern.qsl = qsl_t.data_ptr<int64_t>();
  kern.scale = static_cast<float>(scale);
  kern.window = window;
  kern.shape = Shape{G, D, round_up(D, kPad), 0};
#if defined(SPLITSERVE_HAS_AVX512BF16)
  kern.bf16_dot = std::is_same_v<T, c10::BFloat16> && D % 2 == 0;
#else
  kern.bf16_dot = false;
#endif
  kern.brgemm = (kern.bf16_dot ? g_brgemm_bf16 : g_brgemm_f32).load(std::memory_order_relaxed);

  std::vector<Item> items;
  int64_t max_n = 1;
  for (int64_t i = first; i < R; ++i) {
    const int64_t qlen = kern.qsl[i + 1] - kern.qsl[i];
    const int64_t ctx = kern.seq_lens[i] - qlen;
    for (int64_t t0 = 0; t0 < qlen; t0 += kTileQ) {
      const int64_t tn = std::min(kTileQ, qlen - t0);
      const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx + t0 - window + 1) : 0;
      const int64_t n = ctx + t0 + tn - lo;
      max_n = std::max(max_n, n);
      for (int64_t h = 0; h < Hkv; ++h) items.push_back({i, h, t0, tn, lo, n});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.n > y.n; });
  Shape biggest = kern.shape;
  biggest.npad = round_up(max_n, kern.brgemm ? kBN : kPad);
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    typename Kernel<T>::Scratch scratch(kTileQ * G, biggest);
    for (int64_t w = begin; w < end; ++w)
      for (int64_t i = next++; i < static_cast<int64_t>(items.size()); i = next++) kern.run(items[i], scratch);
    if (kern.brgemm) at::native::cpublas::brgemm_release();
  });
}

}  // namespace

namespace splitserve {

std::tuple<bool, bool> set_prompt_attention_brgemm(bool float32, bool bfloat16) {
  return {g_brgemm_f32.exchange(float32), g_brgemm_bf16.exchange(bfloat16)};
}

// Rows of out [T, Hq, D] (contiguous) for the tokens of requests [first, R): their attention over
// their cached context and themselves. q [T, Hq, D] (any token and head strides, unit dim stride);
// kv_cache [2, Hkv, blocks, block_size, D] with the step's K/V already written; block_tables
// [R, max_blocks] int32; seq_lens [R] int32 (tokens cached after this step); query_start_loc
// [R + 1] int64; sliding_window 0 for none. Rows of other requests are left alone.
void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens,
                       const at::Tensor& query_start_loc, int64_t first, double scale, int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.is_contiguous() && out.sizes() == q.sizes(),
              "q [T, Hq, D] needs unit stride along head_dim; out must be a contiguous tensor of q's shape");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.size(4) == q.size(2),
              "kv_cache must be [2, Hkv, blocks, block_size, D]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "q, out and the cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int32, query_start_loc int64");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous() && query_start_loc.is_contiguous() &&
                  query_start_loc.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) >= seq_lens.size(0),
              "bad block_tables / seq_lens / query_start_loc layout");
  TORCH_CHECK(0 <= first && first <= seq_lens.size(0), "first must index a request");
  TORCH_CHECK(q.size(1) % kv_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  const at::Tensor k_cache = kv_cache.select(0, 0), v_cache = kv_cache.select(0, 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention", [&] {
    prefill_attention_impl<scalar_t>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, first, scale,
                                     sliding_window);
  });
}

}  // namespace splitserve
