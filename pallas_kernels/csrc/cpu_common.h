// What the CPU kernels share besides the work sharing (shared_work.h): the AVX-512 target, the check
// for it at run time, the ue8m0 scale as pallas_kernels.formats reads it, and a lane reduction.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

// The vector loops' target; one build runs on any x86-64 CPU, these functions only where
// `ced::has_avx512()` says so (F16C, which every AVX-512 CPU has, for the e4m3 decode).
#define CED_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))

namespace ced {

inline bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("f16c");
}

// ue8m0 as pallas_kernels.formats.ue8m0_to_f32 reads it: 2^(s-127), 0 reads as 0, 255 is NaN.
inline double ue8m0(uint8_t s) {
  if (s == 0) return 0.0;
  if (s == 255) return std::nan("");
  uint64_t bits = static_cast<uint64_t>(s - 127 + 1023) << 52;
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

// Lane j of the result: the sum of a[j]'s eight lanes (the kernels' sums here are exact, so the
// order of the adds does not matter).
CED_AVX512 inline __m512d sum_lanes_of_8(const __m512d* a) {
  __m512d s01 = _mm512_add_pd(_mm512_unpacklo_pd(a[0], a[1]), _mm512_unpackhi_pd(a[0], a[1]));
  __m512d s23 = _mm512_add_pd(_mm512_unpacklo_pd(a[2], a[3]), _mm512_unpackhi_pd(a[2], a[3]));
  __m512d s45 = _mm512_add_pd(_mm512_unpacklo_pd(a[4], a[5]), _mm512_unpackhi_pd(a[4], a[5]));
  __m512d s67 = _mm512_add_pd(_mm512_unpacklo_pd(a[6], a[7]), _mm512_unpackhi_pd(a[6], a[7]));
  __m512d w0 = _mm512_add_pd(_mm512_shuffle_f64x2(s01, s23, 0x88), _mm512_shuffle_f64x2(s01, s23, 0xDD));
  __m512d w1 = _mm512_add_pd(_mm512_shuffle_f64x2(s45, s67, 0x88), _mm512_shuffle_f64x2(s45, s67, 0xDD));
  return _mm512_add_pd(_mm512_shuffle_f64x2(w0, w1, 0x88), _mm512_shuffle_f64x2(w0, w1, 0xDD));
}

}  // namespace ced
