// What the CPU kernels share besides the work sharing (shared_work.h): the AVX-512 target, the check
// for it at run time, the ue8m0 scale as pallas_kernels.formats reads it, and the order of sums.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

// ue8m0 as pallas_kernels.formats.ue8m0_to_f32 reads it: the byte is the f32 exponent field of
// 2^(s-127), so 0 reads as +0, and 255 is a quiet NaN.
inline float ue8m0_f32(uint8_t s) {
  const uint32_t bits = static_cast<uint32_t>(s) << 23 | (s == 255 ? 1u << 22 : 0u);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The order of sums of the FP4 and FP8 products (bit-identical to the XLA path): XLA:CPU runs an f32
// dot [M, K] x [N, K]^T through YNNPACK, which adds each output's products one by one in index order
// (fused multiply-adds) within runs of 512 values of K, each run from zero, and adds the runs' sums in
// order. Measured on jaxlib 0.10.2 for 2 to 1,024 rows, K up to 7,168 and N a multiple of 64 (every
// weight of the fixtures); with exact products (FP8 or FP4 values times FP8-quantised rows) a fused
// and an unfused multiply-add give the same value. The kernels' tests compare them with the XLA
// path's products, so a jaxlib that sums otherwise fails them.
constexpr int64_t kRun = 512;

// run(std::integral_constant<int, R>{}) with R = rows, 1 to 8 (more reads as 8): the vector loops keep
// R rows' accumulators in registers, so R must be known when they are compiled.
template <typename Run>
inline void with_row_count(int64_t rows, const Run& run) {
  switch (rows) {
    case 1: return run(std::integral_constant<int, 1>{});
    case 2: return run(std::integral_constant<int, 2>{});
    case 3: return run(std::integral_constant<int, 3>{});
    case 4: return run(std::integral_constant<int, 4>{});
    case 5: return run(std::integral_constant<int, 5>{});
    case 6: return run(std::integral_constant<int, 6>{});
    case 7: return run(std::integral_constant<int, 7>{});
    default: return run(std::integral_constant<int, 8>{});
  }
}

}  // namespace ced
