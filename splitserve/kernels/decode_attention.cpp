// Paged decode attention (one query token per request) and the paged KV cache write, read and
// written in place in the cache's blocks. Registered in ops_registry.cpp; decode_stack.cpp calls them
// directly (cpu_ops.h).
//
// Every kernel takes float32, bfloat16 or float16 and computes in float32.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "cpu_ops.h"
#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// s[0, n) = exp(s - max s) in place, left unnormalised; returns 1 / their sum.
inline float softmax_unnormalised(float* s, int64_t n) {
  float mx = -INFINITY;
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_approx(s[t] - mx);
    sum += s[t];
  }
  return 1.f / sum;
}

// ---- paged decode attention ------------------------------------------------------------------
// One query token per request. q, out: [B, Hq, D]; k_cache, v_cache: [Hkv, num_blocks, block_size, D];
// block_tables: [B, max_blocks] int32; seq_lens: [B] int32. Each (request, KV head) pair is one
// work item: it reads its keys and values once, straight from the blocks, for the G query heads
// that share them (no gathered copy of the cache, unlike the torch reference), in groups of up to
// 16 tokens: the group's rows are widened to float32 once and used by all G heads. D is a template
// parameter for the common head sizes (64, 128) so that the row loops unroll into whole vector
// registers; kDynamic takes any other size at run time. With AVX-512 the dot products of a group
// are reduced together (hsum_x16) and the accumulators live in registers. bfloat16 on a CPU with
// AVX512-BF16 skips the widening: its products take the cache rows as they are (decode_item_bf16,
// 1.4-2x faster at 64 requests of 128-256 tokens).
constexpr int64_t kDynamic = 0;
constexpr int64_t kGroup = 16;

// The cache rows of a request's tokens first, first + 1, ..., walked block by block (no division
// per token).
template <typename T>
struct RowWalker {
  const T* head;
  const int32_t* table;
  int64_t block_stride, row_stride, bs, blk, off, last_blk;
  // The walk this thread reads after this one (the values after the keys, the next item's keys
  // after the values), or null: the look-ahead runs on into it.
  const RowWalker* then = nullptr;
  int64_t prefetched_at = -1;  // the block whose look-ahead was last asked for

  const T* next() {
    const T* row = head + table[blk] * block_stride + off * row_stride;
    if (++off == bs) off = 0, ++blk;
    return row;
  }
  // Ask for the next kAhead blocks of this thread's reads while this one is used: blocks are
  // scattered, so the hardware prefetcher cannot guess them. Into L2 (prefetcht2), and on across
  // walks (`then`): on a 2-core AMD EPYC, 64 requests of 192 tokens, 30 layers of SmolLM2's heads
  // (scripts/bench_cpu_kernels.py), a step took 12.1-16.4 ms in bfloat16 against
  // 17.3-21.6 with prefetcht0 and no look-ahead past the walk's end, 31.7-33.4 ms in float32 (AVX2
  // build) against 40.0-41.9: prefetcht0 fills the L1's few miss buffers and stalls the loads of
  // the block in use. Two blocks ahead (four measured no faster). Once per block: callers ask at
  // every group of kGroup rows.
  void prefetch_next_blocks() {
    constexpr int64_t kAhead = 2;
    if (blk == prefetched_at) return;
    prefetched_at = blk;
    const RowWalker* walk = this;
    int64_t b = blk;
    for (int64_t ahead = 1; ahead <= kAhead; ++ahead) {
      if (++b > walk->last_blk) {
        walk = walk->then;
        if (!walk) return;
        b = walk->blk;
      }
      walk->prefetch_block(b);
    }
  }
  void prefetch_block(int64_t b) const {
    const char* start = reinterpret_cast<const char*>(head + table[b] * block_stride);
    for (int64_t byte = 0; byte < bs * row_stride * static_cast<int64_t>(sizeof(T)); byte += 64)
      __builtin_prefetch(start + byte, 0, 1);
  }
};

// Widen up to kGroup rows to float32: rows [m, D] into buf.
template <typename T, int64_t kD>
inline void widen_rows(RowWalker<T>& walk, int64_t m, int64_t D, float* buf) {
  for (int64_t j = 0; j < m; ++j) {
    const T* row = walk.next();
#pragma omp simd
    for (int64_t i = 0; i < (kD == kDynamic ? D : kD); ++i) buf[j * D + i] = static_cast<float>(row[i]);
  }
}

#if defined(SPLITSERVE_ISA_AVX2) && !defined(SPLITSERVE_ISA_AVX512)
// The AVX2 build's products of a group (AVX-512 builds do them inline in score_keys and
// accumulate_values, on 16 lanes).
// scores[0, m) = q . row_j for the m <= 8 rows at buf (D = kD floats each), eight dot products at a time.
template <int64_t kD>
inline void score8(const float* q, const float* buf, int64_t m, float* scores) {
  __m256 dots[8];
  for (int64_t j = 0; j < 8; ++j) {
    __m256 a = _mm256_setzero_ps();
    if (j < m)
      for (int64_t c = 0; c < kD / 8; ++c) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(buf + j * kD + 8 * c), a);
    dots[j] = a;
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums, hsum_x8(dots));
  std::memcpy(scores, sums, m * sizeof(float));
}

// acc[0, kD) += sum_j p[j] row_j over the m rows at buf, eight accumulator registers at a time.
template <int64_t kD>
inline void accumulate8(const float* p, const float* buf, int64_t m, float* acc) {
  for (int64_t c0 = 0; c0 < kD / 8; c0 += 8) {
    const int64_t cn = std::min<int64_t>(8, kD / 8 - c0);
    __m256 a[8];
    for (int64_t c = 0; c < cn; ++c) a[c] = _mm256_loadu_ps(acc + 8 * (c0 + c));
    for (int64_t j = 0; j < m; ++j) {
      const __m256 w = _mm256_set1_ps(p[j]);
      for (int64_t c = 0; c < cn; ++c) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(buf + j * kD + 8 * (c0 + c)), a[c]);
    }
    for (int64_t c = 0; c < cn; ++c) _mm256_storeu_ps(acc + 8 * (c0 + c), a[c]);
  }
}
#endif

// fn(t0, m) for each group of m <= kGroup rows starting at row t0, with the rows widened into buf.
template <typename T, int64_t kD, typename Fn>
void for_each_group(RowWalker<T> walk, int64_t D, int64_t n, float* buf, Fn&& fn) {
  for (int64_t t0 = 0; t0 < n; t0 += kGroup) {
    const int64_t m = std::min(kGroup, n - t0);
    walk.prefetch_next_blocks();
    widen_rows<T, kD>(walk, m, D, buf);
    fn(t0, m);
  }
}

// scores[g * n + t] = q_g . k_t for t in [0, n)
template <typename T, int64_t kD>
void score_keys(RowWalker<T> walk, const float* query, int64_t G, int64_t D, int64_t n, float* scores,
                float* buf) {
  for_each_group<T, kD>(walk, D, n, buf, [&](int64_t t0, int64_t m) {
#if defined(SPLITSERVE_ISA_AVX512)
    if constexpr (kD != kDynamic && kD % 16 == 0) {
      for (int64_t g = 0; g < G; ++g) {
        __m512 qv[kD / 16], dots[kGroup];
        for (int64_t c = 0; c < kD / 16; ++c) qv[c] = _mm512_loadu_ps(query + g * kD + 16 * c);
        for (int64_t j = 0; j < kGroup; ++j) {
          __m512 a = _mm512_setzero_ps();
          if (j < m)
            for (int64_t c = 0; c < kD / 16; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(buf + j * kD + 16 * c), a);
          dots[j] = a;
        }
        _mm512_mask_storeu_ps(scores + g * n + t0, static_cast<__mmask16>((1u << m) - 1), hsum_x16(dots));
      }
      return;
    }
#elif defined(SPLITSERVE_ISA_AVX2)
    if constexpr (kD != kDynamic && kD % 8 == 0) {
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j0 = 0; j0 < m; j0 += 8)
          score8<kD>(query + g * kD, buf + j0 * kD, std::min<int64_t>(8, m - j0), scores + g * n + t0 + j0);
      return;
    }
#endif
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < m; ++j) {
        const float* qg = query + g * D;
        const float* k = buf + j * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < (kD == kDynamic ? D : kD); ++i) dot += qg[i] * k[i];
        scores[g * n + t0 + j] = dot;
      }
  });
}

// acc[g] += sum_t p[g * n + t] v_t for t in [0, n)
template <typename T, int64_t kD>
void accumulate_values(RowWalker<T> walk, const float* p, int64_t G, int64_t D, int64_t n, float* acc,
                       float* buf) {
  for_each_group<T, kD>(walk, D, n, buf, [&](int64_t t0, int64_t m) {
#if defined(SPLITSERVE_ISA_AVX512)
    if constexpr (kD != kDynamic && kD % 16 == 0) {
      for (int64_t g = 0; g < G; ++g) {
        __m512 a[kD / 16];
        for (int64_t c = 0; c < kD / 16; ++c) a[c] = _mm512_loadu_ps(acc + g * kD + 16 * c);
        for (int64_t j = 0; j < m; ++j) {
          const __m512 w = _mm512_set1_ps(p[g * n + t0 + j]);
          for (int64_t c = 0; c < kD / 16; ++c) a[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(buf + j * kD + 16 * c), a[c]);
        }
        for (int64_t c = 0; c < kD / 16; ++c) _mm512_storeu_ps(acc + g * kD + 16 * c, a[c]);
      }
      return;
    }
#elif defined(SPLITSERVE_ISA_AVX2)
    if constexpr (kD != kDynamic && kD % 8 == 0) {
      for (int64_t g = 0; g < G; ++g) accumulate8<kD>(p + g * n + t0, buf, m, acc + g * kD);
      return;
    }
#endif
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < m; ++j) {
        const float w = p[g * n + t0 + j];
        const float* v = buf + j * D;
        float* a = acc + g * D;
#pragma omp simd
        for (int64_t i = 0; i < (kD == kDynamic ? D : kD); ++i) a[i] += w * v[i];
      }
  });
}

#if defined(SPLITSERVE_HAS_AVX512BF16)
// One (request, KV head) item of decode attention in bfloat16 on a CPU with AVX512-BF16: the
// products take pairs of bfloat16 values straight from the cache rows (vdpbf16ps, float32 sums),
// with no widened copy. Scores: a key row's dot product with each query head leaves 16 partial
// sums, which hsum_x16 folds for 16 keys at once. Values: two key rows interleaved by 16-bit
// unpacks give the (key, next key) pairs of each head dim, multiplied by the heads' bfloat16
// probability pairs; the unpacks leave the dims of each 32-dim chunk in the order
// [0-3, 8-11, 16-19, 24-27] (lo) and [4-7, 12-15, 20-23, 28-31] (hi), put back at the end.
// Probabilities are rounded to bfloat16 (as the torch reference rounds them) and normalised by
// the float32 sum. q: [G][kD] bfloat16 rows (unscaled); out: [G][kD] float32, normalised.
template <int64_t kD>
void decode_item_bf16(RowWalker<c10::BFloat16> keys, RowWalker<c10::BFloat16> values, const c10::BFloat16* q,
                      int64_t q_head_stride, int64_t G, int64_t n, float scale, std::vector<float>& scores,
                      std::vector<c10::BFloat16>& probs, float* out) {
  constexpr int64_t kC = kD / 32;  // 512-bit chunks per row
  scores.resize(G * n);
  for (int64_t t0 = 0; t0 < n; t0 += kGroup) {
    const int64_t m = std::min(kGroup, n - t0);
    keys.prefetch_next_blocks();
    const c10::BFloat16* rows[kGroup];
    for (int64_t j = 0; j < m; ++j) rows[j] = keys.next();
    for (int64_t g = 0; g < G; ++g) {
      __m512bh qv[kC];
      for (int64_t c = 0; c < kC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + g * q_head_stride + 32 * c);
      __m512 dots[kGroup];
      for (int64_t j = 0; j < kGroup; ++j) {
        __m512 a = _mm512_setzero_ps();
        if (j < m)
          for (int64_t c = 0; c < kC; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(rows[j] + 32 * c));
        dots[j] = a;
      }
      _mm512_mask_storeu_ps(&scores[g * n + t0], static_cast<__mmask16>((1u << m) - 1),
                            _mm512_mul_ps(hsum_x16(dots), _mm512_set1_ps(scale)));
    }
  }
  const int64_t half = (n + 1) / 2;
  probs.resize(G * 2 * half);
  float inv_sum[16];
  for (int64_t g = 0; g < G; ++g) {
    float* s = &scores[g * n];
    inv_sum[g] = softmax_unnormalised(s, n);
    c10::BFloat16* pg = &probs[g * 2 * half];
    int64_t t = 0;  // 16 at a time: the values are 0 or normal floats, which store() rounds as c10 does
    for (; t + 16 <= n; t += 16) store(pg + t, _mm512_loadu_ps(s + t));
    for (; t < n; ++t) pg[t] = c10::BFloat16(s[t]);
    if (n % 2) pg[n] = c10::BFloat16(0.f);
  }
  __m512 lo[16][kC], hi[16][kC];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < kC; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
  const __m512i zero_row = _mm512_setzero_si512();
  for (int64_t k = 0; k < half; ++k) {
    if (k % (kGroup / 2) == 0) values.prefetch_next_blocks();
    const c10::BFloat16* r0 = values.next();
    const c10::BFloat16* r1 = 2 * k + 1 < n ? values.next() : nullptr;
    __m512bh plo[kC], phi[kC];
    for (int64_t c = 0; c < kC; ++c) {
      const __m512i a = _mm512_loadu_si512(r0 + 32 * c);
      const __m512i b = r1 ? _mm512_loadu_si512(r1 + 32 * c) : zero_row;
      plo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      phi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int64_t g = 0; g < G; ++g) {
      uint32_t word;
      std::memcpy(&word, &probs[g * 2 * half + 2 * k], sizeof(word));
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
      for (int64_t c = 0; c < kC; ++c) {
        lo[g][c] = _mm512_dpbf16_ps(lo[g][c], p, plo[c]);
        hi[g][c] = _mm512_dpbf16_ps(hi[g][c], p, phi[c]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < kC; ++c) {
      alignas(64) float a[16], b[16];
      _mm512_store_ps(a, _mm512_mul_ps(lo[g][c], _mm512_set1_ps(inv_sum[g])));
      _mm512_store_ps(b, _mm512_mul_ps(hi[g][c], _mm512_set1_ps(inv_sum[g])));
      float* dst = out + g * kD + 32 * c;
      for (int i = 0; i < 16; ++i) {
        dst[8 * (i / 4) + i % 4] = a[i];
        dst[8 * (i / 4) + 4 + i % 4] = b[i];
      }
    }
}
#endif

template <typename T, int64_t kD>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, int64_t B, double scale, int64_t sliding_window) {
  const int64_t Hq = q.size(1), q_token_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t D = kD == kDynamic ? q.size(2) : kD;
  const int64_t Hkv = k_cache.size(0), bs = k_cache.size(2);
  const int64_t G = Hq / Hkv;
  const int64_t head_stride = k_cache.stride(0), block_stride = k_cache.stride(1);
  const int64_t table_stride = block_tables.stride(0);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);

  // The walk over item's keys (values: v_cache) from its first token in the window.
  auto walker = [&](const T* cache, int64_t item) -> RowWalker<T> {
    const int64_t b = item / Hkv, h = item % Hkv, len = lens[b];
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
    return {cache + h * head_stride, tables + b * table_stride, block_stride, D, bs, first / bs, first % bs,
            (len - 1) / bs};
  };

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(G * D), acc(G * D), buf(kGroup * D), scores, inv_sum(G);
    std::vector<T> probs;  // the AVX512-BF16 path's bfloat16 probabilities
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t len = lens[b];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t n = len - first;
      // keys, then values, then the next item's keys: each walk's look-ahead runs on into the next
      RowWalker<T> keys = walker(kp, item), values = walker(vp, item), next_keys{};
      keys.then = &values;
      if (item + 1 < end) {
        next_keys = walker(kp, item + 1);
        values.then = &next_keys;
      }
#if defined(SPLITSERVE_HAS_AVX512BF16)
      if constexpr (std::is_same_v<T, c10::BFloat16> && kD != kDynamic && kD % 32 == 0) {
        if (G <= 16) {
          decode_item_bf16<kD>(keys, values, qp + b * q_token_stride + h * G * q_head_stride, q_head_stride, G, n,
                               fscale, scores, probs, acc.data());
          for (int64_t g = 0; g < G; ++g) {
            T* dst = op + (b * Hq + h * G + g) * D;
            for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[g * D + i]);
          }
          continue;
        }
      }
#endif
      for (int64_t g = 0; g < G; ++g) {
        const T* src = qp + b * q_token_stride + (h * G + g) * q_head_stride;
        for (int64_t i = 0; i < D; ++i) query[g * D + i] = static_cast<float>(src[i]) * fscale;
      }
      scores.resize(G * n);
      score_keys<T, kD>(keys, query.data(), G, D, n, scores.data(), buf.data());
      // softmax over t, left unnormalised until the end
      for (int64_t g = 0; g < G; ++g) inv_sum[g] = softmax_unnormalised(&scores[g * n], n);
      std::fill(acc.begin(), acc.end(), 0.f);
      accumulate_values<T, kD>(values, scores.data(), G, D, n, acc.data(), buf.data());
      for (int64_t g = 0; g < G; ++g) {
        T* dst = op + (b * Hq + h * G + g) * D;
        for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[g * D + i] * inv_sum[g]);
      }
    }
  });
}

// ---- KV cache write ----------------------------------------------------------------------------
// k, v: [T, Hkv, D] (any token stride, packed heads) into kv_cache [2, Hkv, num_blocks, block_size, D]
// at the slots (block * block_size + offset) of slot_mapping [T] int64.
template <typename T>
void write_kv_impl(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  const int64_t T_ = k.size(0), H = k.size(1), D = k.size(2);
  const int64_t head_stride = kv_cache.stride(1), kv_stride = kv_cache.stride(0);
  const int64_t ks = k.stride(0), vs = v.stride(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  T* cp = kv_cache.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  at::parallel_for(0, T_, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < H; ++h) {
        T* dst = cp + h * head_stride + sp[t] * D;
        std::memcpy(dst, kp + t * ks + h * D, D * sizeof(T));
        std::memcpy(dst + kv_stride, vp + t * vs + h * D, D * sizeof(T));
      }
  });
}

}  // namespace

namespace splitserve {

// The first num_decodes rows of q [T, Hq, D] (any token and head strides) into the same rows of out
// [T, Hq, D] (contiguous); kv_cache [2, Hkv, num_blocks, block_size, D]; block_tables and seq_lens
// as the model runner builds them for the whole step (decodes first).
void decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_decodes,
                      double scale, int64_t sliding_window) {
  TORCH_CHECK(q.stride(2) == 1 && out.is_contiguous(), "q needs unit stride along head_dim; out must be contiguous");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be [2, Hkv, blocks, block_size, D]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "q, out and the cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous(), "bad block_tables / seq_lens layout");
  TORCH_CHECK(num_decodes <= q.size(0) && num_decodes <= block_tables.size(0) && num_decodes <= seq_lens.size(0),
              "num_decodes exceeds the batch");
  TORCH_CHECK(q.size(1) % kv_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  const at::Tensor k_cache = kv_cache.select(0, 0), v_cache = kv_cache.select(0, 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    switch (q.size(2)) {
      case 64: return decode_attention_impl<scalar_t, 64>(out, q, k_cache, v_cache, block_tables, seq_lens, num_decodes, scale, sliding_window);
      case 128: return decode_attention_impl<scalar_t, 128>(out, q, k_cache, v_cache, block_tables, seq_lens, num_decodes, scale, sliding_window);
      default: return decode_attention_impl<scalar_t, kDynamic>(out, q, k_cache, v_cache, block_tables, seq_lens, num_decodes, scale, sliding_window);
    }
  });
}

// k, v [T, Hkv, D] into kv_cache at slot_mapping [T] (see write_kv_impl).
void write_kv(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be [2, Hkv, blocks, block_size, D]");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "k and v must have packed heads");
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type(),
              "k, v and the cache must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == k.size(0), "slot_mapping must be [T] int64");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    write_kv_impl<scalar_t>(kv_cache, k, v, slot_mapping);
  });
}

}  // namespace splitserve
