// gguf_products.cpp's few-rows path on repacked weights (gguf_repack.h: 16 weight rows interleaved
// per record): integer dot products of 16 weight rows at a time. Not a standalone header: it is
// included once, inside gguf_products.cpp's anonymous namespace, where the records' formats
// (gguf_formats.h, gguf_repack.h), QuantizedX, quantize_x, ChunkScales and in_passes_of_x_rows are
// already declared; it holds what would otherwise push that file past the size rule.
#pragma once

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

#if defined(SPLITSERVE_ISA_AVX512)
// lane l += the dot product of u's 4 unsigned bytes and s's 4 signed ones in lane l
inline __m512i dot_add(__m512i acc, __m512i u, __m512i s) {
#if defined(SPLITSERVE_HAS_AVX512VNNI)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

// Q8_0's records: whole int8 codes, four per 32-bit lane. With VNNI the codes, biased by 128, are the
// unsigned operand of vpdpbusd (the bias comes off with x's code sum: xd * sum((c + 128) xq) = xd *
// sum(c xq) + 128 xsum); without it |code| and x's codes with the code's sign go through vpmaddubsw,
// whose pair sums (at most 2 * 128 * 127) then fit int16.
template <int R, typename T>
void dot_group_q8(const uint8_t* group, int64_t chunks, const QuantizedX& x, int64_t m0, T* out, int64_t out_stride) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* rec = group + c * Record<Q8_0>::kBytes;
    const uint8_t* codes = rec + Record<Q8_0>::kCodesAt;
    __m512i sum[R][2];  // two chains of dependent dot products rather than one
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i w = _mm512_loadu_si512(codes + 64 * j);
#if defined(SPLITSERVE_HAS_AVX512VNNI)
      const __m512i u = _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));
#else
      const __m512i u = _mm512_abs_epi8(w);
      const __mmask64 negative = _mm512_movepi8_mask(w);
#endif
      for (int r = 0; r < R; ++r) {
        const __m512i xs = _mm512_set1_epi32(load_i32(x.q_row(m0 + r) + c * kChunk + 4 * j));
#if defined(SPLITSERVE_HAS_AVX512VNNI)
        sum[r][j & 1] = _mm512_dpbusd_epi32(sum[r][j & 1], u, xs);
#else
        const __m512i signed_x = _mm512_mask_sub_epi8(xs, negative, _mm512_setzero_si512(), xs);
        const __m512i pairs = _mm512_maddubs_epi16(u, signed_x);
        sum[r][j & 1] = _mm512_add_epi32(sum[r][j & 1], _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
      }
    }
    const __m512 d = _mm512_cvtph_ps(load256(rec));
    for (int r = 0; r < R; ++r) {
      const float xd = x.scale_row(m0 + r)[2 * c];
      const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(sum[r][0], sum[r][1]));
#if defined(SPLITSERVE_HAS_AVX512VNNI)
      const float xsum = x.sum_row(m0 + r)[2 * c] + x.sum_row(m0 + r)[2 * c + 1];
      const __m512 dot = _mm512_fmadd_ps(isum, _mm512_set1_ps(xd), _mm512_set1_ps(-128.f * xsum));
#else
      const __m512 dot = _mm512_mul_ps(isum, _mm512_set1_ps(xd));
#endif
      acc[r] = _mm512_fmadd_ps(d, dot, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store(out + r * out_stride, acc[r]);
}

template <class Q, int R, typename T>
void dot_group(const uint8_t* group, int64_t chunks, const QuantizedX& x, int64_t m0, T* out, int64_t out_stride) {
  if constexpr (Record<Q>::kByteCodes) {
    dot_group_q8<R>(group, chunks, x, m0, out, out_stride);
    return;
  }
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
#elif defined(SPLITSERVE_ISA_AVX2)
// Two 8-row halves per group. maddubs' int16 pair sums are added up in int16 over the whole chunk:
// 4-bit codes times |xq| <= 127 keep the 16 pairs of a lane within 16 * 15 * 127 = 30480.
// Q8_0's records: |code| and x's codes with the code's sign through vpmaddubsw (pair sums of at most
// 2 * 128 * 127 fit int16), widened to int32 at once: eight 4-code steps would not.
template <int R, typename T>
void dot_group_q8(const uint8_t* group, int64_t chunks, const QuantizedX& x, int64_t m0, T* out, int64_t out_stride) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* rec = group + c * Record<Q8_0>::kBytes;
    const uint8_t* codes = rec + Record<Q8_0>::kCodesAt;
    __m256i sums[R][2];
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      for (int h = 0; h < 2; ++h) {
        const __m256i w = load256(codes + 64 * j + 32 * h);
        const __m256i magnitude = _mm256_sign_epi8(w, w);
        for (int r = 0; r < R; ++r) {
          const __m256i xs = _mm256_set1_epi32(load_i32(x.q_row(m0 + r) + c * kChunk + 4 * j));
          const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xs, w));
          sums[r][h] = _mm256_add_epi32(sums[r][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * h)));
      for (int r = 0; r < R; ++r) {
        const __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(sums[r][h]), _mm256_set1_ps(x.scale_row(m0 + r)[2 * c]));
        acc[r][h] = _mm256_fmadd_ps(d, dot, acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) store(out + r * out_stride + 8 * h, acc[r][h]);
}

template <class Q, int R, typename T>
void dot_group(const uint8_t* group, int64_t chunks, const QuantizedX& x, int64_t m0, T* out, int64_t out_stride) {
  if constexpr (Record<Q>::kByteCodes) {
    dot_group_q8<R>(group, chunks, x, m0, out, out_stride);
    return;
  }
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
      repacked_codes<Q>(rec + Record<Q>::kCodesAt, i, w);
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
