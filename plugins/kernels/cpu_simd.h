// SIMD helpers shared by the CPU kernels: one traits struct per vector unit (AVX-512: 16
// floats, AVX2: 8), so that the vectorised loops are written once.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>
#include <type_traits>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace servelab_simd {

#ifdef __AVX512F__
struct Avx512 {
  using V = __m512;
  static constexpr int kWidth = 16;

  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // x with `fill` in the lanes where positions < limit.
  static V fill_below(V x, V positions, float limit, float fill) {
    return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(positions, _mm512_set1_ps(limit), _CMP_LT_OQ), _mm512_set1_ps(fill));
  }
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V load_first(const float* p, int n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p); }
  static void store_first(float* p, V v, int n) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v); }
  static float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }

  // Sixteen values widened to float32 (bfloat16 is the high half of a float32).
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static V load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V load(const double* p) {  // float64: correct, not fast
    alignas(64) float widened[kWidth];
    for (int i = 0; i < kWidth; ++i) widened[i] = static_cast<float>(p[i]);
    return _mm512_load_ps(widened);
  }

  // Lane j of the result is the sum of the lanes of v[j].
  static V sum_each(const V v[kWidth]) {
    V pairs[8], quads[4];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
      pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // per 128-bit lane: one partial sum of each of four vectors
      quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const V low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const V high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
  }

  // p * 2^n for the exponential below.
  static V scale_by_power_of_two(V p, V n) { return _mm512_scalef_ps(p, n); }
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

  // The bfloat16 nearest each lane (ties to even; NaN as 0x7FC0), as c10::BFloat16(float)
  // rounds, in the low half of each 32-bit lane.
  static __m512i bfloat16_bits(V x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7FFF));
    const __m512i nearest = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    return _mm512_mask_mov_epi32(nearest, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  }
  // x rounded as a cast to scalar_t rounds it, widened back (float32: x itself).
  static V rounded(V x, const float*) { return x; }
  static V rounded(V x, const c10::BFloat16*) { return _mm512_castsi512_ps(_mm512_slli_epi32(bfloat16_bits(x), 16)); }
  // Sixteen values stored as scalar_t, rounded as a cast rounds them.
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static void store(c10::BFloat16* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bfloat16_bits(x)));
  }
};
#endif  // __AVX512F__

#ifdef __AVX2__
struct Avx2 {
  using V = __m256;
  static constexpr int kWidth = 8;

  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fill_below(V x, V positions, float limit, float fill) {
    return _mm256_blendv_ps(x, _mm256_set1_ps(fill), _mm256_cmp_ps(positions, _mm256_set1_ps(limit), _CMP_LT_OQ));
  }
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V load_first(const float* p, int n) {
    alignas(32) float buffer[kWidth] = {};
    std::memcpy(buffer, p, n * sizeof(float));
    return _mm256_load_ps(buffer);
  }
  static void store_first(float* p, V v, int n) {
    alignas(32) float buffer[kWidth];
    _mm256_store_ps(buffer, v);
    std::memcpy(p, buffer, n * sizeof(float));
  }
  static float reduce_add(V v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
  }
  static float reduce_max(V v) {
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
  }

  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static V load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static V load(const double* p) {
    alignas(32) float widened[kWidth];
    for (int i = 0; i < kWidth; ++i) widened[i] = static_cast<float>(p[i]);
    return _mm256_load_ps(widened);
  }

  static V sum_each(const V v[kWidth]) {
    const V t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const V t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const V u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: four partial sums
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }

  static V scale_by_power_of_two(V p, V n) {  // n in [-126, 127]: a normal float's exponent
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

  static __m256i bfloat16_bits(V x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                          _mm256_set1_epi32(0x7FFF));
    const __m256i nearest = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    return _mm256_blendv_epi8(nearest, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  }
  static V rounded(V x, const float*) { return x; }
  static V rounded(V x, const c10::BFloat16*) { return _mm256_castsi256_ps(_mm256_slli_epi32(bfloat16_bits(x), 16)); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static void store(c10::BFloat16* p, V x) {
    const __m256i bits = bfloat16_bits(x);  // each value < 2^16: the unsigned pack keeps it
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
  }
};
#endif  // __AVX2__

// e^x: 2^n * p(r), r = x - n ln 2, |r| <= ln2 / 2, with p the degree-7 Taylor polynomial
// (relative error below 1e-7). x is clamped to [-87, 88]: below, the result is ~1e-38
// instead of smaller (it only ever weighs softmax terms); above, float overflows.
template <typename S>
inline typename S::V exp(typename S::V x) {
  x = S::min(S::max(x, S::set1(-87.f)), S::set1(88.f));
  const typename S::V n = S::round(S::fmadd(x, S::set1(1.44269504088896341f), S::zero()));
  typename S::V r = S::fmadd(n, S::set1(-0.693145751953125f), x);
  r = S::fmadd(n, S::set1(-1.428606765330187045e-06f), r);
  typename S::V p = S::set1(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = S::fmadd(p, r, S::set1(c));
  return S::scale_by_power_of_two(p, n);
}

// Whether the traits above round and store scalar_t (float32 and bfloat16; float16 takes
// the scalar loops).
template <typename scalar_t>
constexpr bool kStores = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;

#if defined(__AVX512F__)
using Native = Avx512;
constexpr bool kHasVectorUnit = true;
#elif defined(__AVX2__)
using Native = Avx2;
constexpr bool kHasVectorUnit = true;
#else
struct Native {  // no vectorised path: the kernels take their scalar loops
  static constexpr int kWidth = 1;
};
constexpr bool kHasVectorUnit = false;
#endif

}  // namespace servelab_simd
