// The fused element-wise steps of a decoder layer: RMSNorm (with or without the residual add
// before it), rotary and SiLU-and-mul. Registered in ops_registry.cpp; decode_stack.cpp calls them
// directly (cpu_ops.h). Parallelised with at::parallel_for on torch's own OpenMP threads, and
// vectorised on cpu_simd.h's vec, whose conversions (vload_as, vstore_as, vround_as) round as the
// scalar static_cast does; a row's last H % kVecWidth values take the scalar loop.
//
// Every kernel takes float32, bfloat16 or float16 and computes in float32, rounding to the tensor
// dtype at the same points as the torch code it replaces (see each), so that bfloat16 results match
// the unfused torch ops bit for bit except where an exp differs in its last float32 bit.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "cpu_ops.h"
#include "cpu_simd.h"

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

// ---- residual add + RMSNorm ------------------------------------------------------------------
// x, residual: [T, H] (rows may be strided); weight: [H]. When `add`: residual <- round(x + residual)
// first. Then out <- round(weight * round(r * rsqrt(mean(r^2) + eps))) with r the (new) residual
// in float32: transformers' RMSNorm, which normalises in float32 and casts back before the weight.
template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                   double eps, bool add) {
  const int64_t T_ = x.size(0), H = x.size(1);
  const int64_t xs = x.stride(0), rs = add ? residual.stride(0) : 0, os = out.stride(0);
  const T* xp = x.data_ptr<T>();
  T* rp = add ? residual.data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    const int64_t Hv = vectorised_part<T>(H);  // whole vectors; the rest one value at a time
    for (int64_t t = begin; t < end; ++t) {
      const T* a = xp + t * xs;
      if (add) {
        T* r = rp + t * rs;
        if constexpr (kVecAs<T>)
          for (int64_t i = 0; i < Hv; i += kVecWidth) {
            const vec sum = vround_as<T>(vadd(vload_as(a + i), vload_as(r + i)));
            vstore_as(r + i, sum);
            vstore(&row[i], sum);
          }
        for (int64_t i = Hv; i < H; ++i) {
          r[i] = static_cast<T>(static_cast<float>(a[i]) + static_cast<float>(r[i]));
          row[i] = static_cast<float>(r[i]);
        }
      } else {
        if constexpr (kVecAs<T>)
          for (int64_t i = 0; i < Hv; i += kVecWidth) vstore(&row[i], vload_as(a + i));
        for (int64_t i = Hv; i < H; ++i) row[i] = static_cast<float>(a[i]);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += row[i] * row[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      T* o = op + t * os;
      if constexpr (kVecAs<T>)
        for (int64_t i = 0; i < Hv; i += kVecWidth)
          vstore_as(o + i, vmul(vload_as(wp + i), vround_as<T>(vmul(vload(&row[i]), vset1(inv)))));
      for (int64_t i = Hv; i < H; ++i) {
        const float normed = static_cast<float>(static_cast<T>(row[i] * inv));
        o[i] = static_cast<T>(static_cast<float>(wp[i]) * normed);
      }
    }
  });
}

// ---- rotary, in place ------------------------------------------------------------------------
// q: [T, Hq, D], k: [T, Hk, D] (token rows may be strided, heads packed); cos, sin: [T, D] in the
// same dtype. The rotate-half form: x <- round(round(x * cos) + round(rotate_half(x) * sin)).
template <typename T>
void rotate(T* x, const T* c, const T* s, int64_t D) {
  const int64_t half = D / 2, vectorised = vectorised_part<T>(half);
  if constexpr (kVecAs<T>)
    for (int64_t i = 0; i < vectorised; i += kVecWidth) {
      const vec x1 = vload_as(x + i), x2 = vload_as(x + i + half);
      const vec a1 = vround_as<T>(vmul(x1, vload_as(c + i)));
      const vec b1 = vround_as<T>(vmul(vneg(x2), vload_as(s + i)));
      const vec a2 = vround_as<T>(vmul(x2, vload_as(c + i + half)));
      const vec b2 = vround_as<T>(vmul(x1, vload_as(s + i + half)));
      vstore_as(x + i, vadd(a1, b1));
      vstore_as(x + i + half, vadd(a2, b2));
    }
  for (int64_t i = vectorised; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    const float a1 = static_cast<float>(static_cast<T>(x1 * static_cast<float>(c[i])));
    const float b1 = static_cast<float>(static_cast<T>(-x2 * static_cast<float>(s[i])));
    const float a2 = static_cast<float>(static_cast<T>(x2 * static_cast<float>(c[i + half])));
    const float b2 = static_cast<float>(static_cast<T>(x1 * static_cast<float>(s[i + half])));
    x[i] = static_cast<T>(a1 + b1);
    x[i + half] = static_cast<T>(a2 + b2);
  }
}

template <typename T>
void rotary_impl(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t T_ = q.size(0), Hq = q.size(1), Hk = k.size(1), D = q.size(2);
  const int64_t qs = q.stride(0), ks = k.stride(0);
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * D;
      const T* s = sp + t * D;
      for (int64_t h = 0; h < Hq; ++h) rotate(qp + t * qs + h * D, c, s, D);
      for (int64_t h = 0; h < Hk; ++h) rotate(kp + t * ks + h * D, c, s, D);
    }
  });
}

// ---- SiLU and mul ----------------------------------------------------------------------------
// x: [T, 2I] = [gate | up] -> [T, I] = round(round(silu(gate)) * up), as F.silu(gate) * up.
//
// round(silu(gate)) for a 16-bit gate: a bfloat16 or float16 gate has only 65536 values, so its
// rounded SiLU comes from a table made once from the scalar expression below (exp_approx gives the
// bits vexp gives, cpu_simd.h), gathered 16 or 8 lanes at a time, in place of the exp and the
// division (about 40 instructions a vector). 64 x 1536 bfloat16 on a 2-core AMD EPYC (Zen 4, whose
// gathers are slow: two thirds of the kernel's time), scripts/bench_cpu_kernels.py: 34-35 us a call
// against 42 in the AVX-512 build, 44 against 79-83 in the AVX2 build.
template <typename T>
inline float silu_rounded(float g) {
  return static_cast<float>(static_cast<T>(g / (1.f + exp_approx(-g))));
}

template <typename T>
const uint16_t* silu_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(65536 + 1);  // one spare entry: a 32-bit gather at the last reads two
    for (uint32_t bits = 0; bits < 65536; ++bits) {
      const T act(silu_rounded<T>(static_cast<float>(T(static_cast<uint16_t>(bits), T::from_bits()))));
      t[bits] = act.x;
    }
    return t;
  }();
  return table.data();
}

// The table's entry for one gate, widened to float32.
template <typename T>
inline float silu_lookup(const uint16_t* table, T gate) {
  return static_cast<float>(T(table[gate.x], T::from_bits()));
}

#if defined(SPLITSERVE_ISA_AVX512)
// The table's entries for kVecWidth gates at p, widened to float32.
template <typename T>
inline vec vsilu_lookup(const uint16_t* table, const T* p) {
  const __m512i idx = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i entry = _mm512_i32gather_epi32(idx, table, 2);  // the entry in each lane's low 16 bits
  if constexpr (std::is_same_v<T, c10::BFloat16>) return _mm512_castsi512_ps(_mm512_slli_epi32(entry, 16));
  else return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(entry));
}
#elif defined(SPLITSERVE_ISA_AVX2)
template <typename T>
inline vec vsilu_lookup(const uint16_t* table, const T* p) {
  const __m256i idx = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i entry = _mm256_i32gather_epi32(reinterpret_cast<const int*>(table), idx, 2);
  if constexpr (std::is_same_v<T, c10::BFloat16>) return _mm256_castsi256_ps(_mm256_slli_epi32(entry, 16));
  else {
    const __m256i low = _mm256_and_si256(entry, _mm256_set1_epi32(0xFFFF));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1)));
  }
}
#else
template <typename T>
inline vec vsilu_lookup(const uint16_t* table, const T* p) {
  return silu_lookup(table, *p);
}
#endif

template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t T_ = x.size(0), I = out.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t Iv = vectorised_part<T>(I);  // whole vectors; the rest one value at a time
  constexpr bool kTable = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;
  const uint16_t* table = nullptr;
  if constexpr (kTable) table = silu_table<T>();
  at::parallel_for(0, T_, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = xp + t * xs;
      const T* up = gate + I;
      T* o = op + t * I;
      if constexpr (kTable) {
        for (int64_t i = 0; i < Iv; i += kVecWidth) vstore_as(o + i, vmul(vsilu_lookup(table, gate + i), vload_as(up + i)));
        for (int64_t i = Iv; i < I; ++i)
          o[i] = static_cast<T>(silu_lookup(table, gate[i]) * static_cast<float>(up[i]));
      } else {
        if constexpr (kVecAs<T>)
          for (int64_t i = 0; i < Iv; i += kVecWidth) {
            const vec g = vload_as(gate + i);
            const vec act = vround_as<T>(vdiv(g, vadd(vset1(1.f), vexp(vneg(g)))));
            vstore_as(o + i, vmul(act, vload_as(up + i)));
          }
        for (int64_t i = Iv; i < I; ++i)
          o[i] = static_cast<T>(silu_rounded<T>(static_cast<float>(gate[i])) * static_cast<float>(up[i]));
      }
    }
  });
}

}  // namespace

namespace splitserve {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous(), "x must be [T, H] with unit stride");
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor none;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(out, x, none, weight, eps, false);
  });
  return out;
}

// residual += x (in place); returns rms_norm(residual).
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && residual.stride(1) == 1 && weight.is_contiguous(),
              "x and residual must be [T, H] with unit stride");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual must match");
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_impl<scalar_t>(out, x, residual, weight, eps, true);
  });
  return out;
}

void rotary(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(2) == 1 && k.stride(1) == k.size(2),
              "q and k must have packed heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == q.size(0) * q.size(2),
              "cos and sin must be [T, D] contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == cos.scalar_type(), "dtypes must match");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    rotary_impl<scalar_t>(q, k, cos, sin);
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x must be [T, 2I] with unit stride");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(out, x);
  });
  return out;
}

}  // namespace splitserve
