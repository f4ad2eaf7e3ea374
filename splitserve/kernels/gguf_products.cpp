// gguf_mm: x @ W.T with W in GGUF blocks, as they lie in the .gguf file or repacked (gguf_repack.h).
// Registered in ops_registry.cpp; decode_stack.cpp calls it directly (cpu_ops.h).
//
// gguf_mm takes one of two paths:
//  - a few rows of x (decode, memory bound): each row of x is quantized once per call to 8-bit
//    integers, a float scale per 32 values as the weights have, and each weight row is unpacked
//    once and multiplied with all the x rows in integer dot products (AVX-512 VNNI, AVX-512BW,
//    AVX2, or plain loops), scaled in float once per chunk; Q4_0 and Q4_1 weights repacked by
//    gguf_repack (16 rows interleaved, gguf_repack.h) take 16 rows at a time;
//  - many rows (prefill, compute bound): each thread dequantizes tiles of its weight rows into a
//    float32 or bfloat16 buffer and multiplies them into their columns of the output with at::mm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include "cpu_ops.h"
#include "cpu_simd.h"
#include "gguf_formats.h"
#include "gguf_repack.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kAuto = 0, kInteger = 1, kTiles = 2;  // gguf_mm's `path` (splitserve.kernels.gguf)
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
// Repacked Q8_0 (a tied LM head, 49152 x 576, bfloat16 x, same CPU): integers 0.31 / 1.35 / 4.2 / 13.2 /
// 19.5 ms at M = 1 / 16 / 64 / 128 / 256 rows against 2.4 / 3.1 / 5.8 / 15.1 / 21.8 ms for the tiles.
constexpr int64_t kRepackedQ8DequantizeFromRows = 512;
// Bytes of dequantized weights per tile (per thread). Large, because at::mm has a fixed cost per
// call (~15 us in bfloat16 with oneDNN, ~3 us in float32): 4 MiB tiles measured 15-25% faster than
// 256 KiB ones at M = 16 and as fast at M = 256 (they are then read from L3 rather than L2).
constexpr int64_t kTileBytes = 4 << 20;

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

#if defined(SPLITSERVE_ISA_AVX2)
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
#if defined(SPLITSERVE_ISA_AVX512)
// 16 int32 lanes: sums of 4 products of u and s each, lanes 4h .. 4h + 3 for bytes 16h .. 16h + 15.
inline __m512i dot16(__m512i u, __m512i s) {
#if defined(SPLITSERVE_HAS_AVX512VNNI)
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
  float total() const { return hsum(acc) + hsum(bias); }
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
  float total() const { return hsum(acc) + hsum(bias); }
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

#if defined(SPLITSERVE_ISA_AVX2)
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
#if defined(SPLITSERVE_ISA_AVX2)
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

#include "gguf_products_repacked.h"  // few rows on repacked weights: mm_integer_repacked

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

// x @ W.T for a weight of format Q in the block layout or repacked. `path` kAuto: integers for a few
// rows of x, dequantized tiles from the layout's threshold on; kInteger or kTiles: that path whatever
// the row count (batch-invariant numerics choose by what the rows are, not by how many).
template <class Q, bool kIsRepacked>
at::Tensor mm(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K, bool native_bf16, int64_t path) {
  const bool bf16_tiles = x.scalar_type() == at::kBFloat16 && native_bf16;
  const int64_t repacked_from = std::is_same_v<Q, Q8_0> ? kRepackedQ8DequantizeFromRows
                                : (bf16_tiles ? kRepackedDequantizeFromRowsBf16 : kRepackedDequantizeFromRows);
  const int64_t from = kIsRepacked ? repacked_from : (bf16_tiles ? kDequantizeFromRowsBf16 : kDequantizeFromRows);
  TORCH_CHECK(path == kAuto || path == kInteger || path == kTiles, "gguf_mm: path must be 0, 1 or 2, got ", path);
  if (path == kTiles || (path == kAuto && x.size(0) >= from))
    return mm_dequantized<Q, kIsRepacked>(x, w, N, K, bf16_tiles);
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

}  // namespace

namespace splitserve {

at::Tensor gguf_mm(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t N, int64_t K, bool native_bf16,
                   int64_t path) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, K] with K = ", K, ", got ", x.sizes());
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 CPU tensor, got ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  if (qtype >= kRepacked) {
    return with_repackable_format(qtype - kRepacked, [&](auto format) {
      using Q = decltype(format);
      check_repacked_weight<Q>(w, N, K);
      return mm<Q, true>(x, w, N, K, native_bf16, path);
    });
  }
  return with_format(qtype, [&](auto format) {
    using Q = decltype(format);
    check_weight<Q>(w, N, K);
    return mm<Q, false>(x, w, N, K, native_bf16, path);
  });
}

}  // namespace splitserve
