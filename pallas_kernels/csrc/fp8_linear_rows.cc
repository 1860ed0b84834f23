// The FP8 block-scaled linear on CPU, an XLA FFI custom call (pallas_kernels.fp8_linear.kernel_cpu,
// issue 38): out[m, n] = rows[m] . dequant(weight)[n], the e4m3 weight decoded inside the dot.
//
// One order, whatever the shapes: each 32-value block of a row against a weight row (one ue8m0 scale
// of the 32 x 32 grid) summed exactly (in double: the rows are FP8-quantised, so every product of two
// e4m3 values times powers of two and every partial sum of a block is exact there, whatever the
// order), its scale applied, rounded once to f32; the blocks added in index order in f32 (the order of
// the FP4 expert kernel). Work items are (chunk of columns, tile of rows): a weight block is decoded
// once per tile of rows.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "cpu_common.h"
#include "shared_work.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kBlock = 32;       // values per scale along K, and weight rows per scale along N
constexpr int64_t kChunk = 64;   // columns of one work item
constexpr int64_t kTile = 32;    // rows of one work item

// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m * 2^-9);
// 0x7F / 0xFF are NaN, there is no infinity.
double e4m3_value(uint8_t code) {
  const int e = (code >> 3) & 15, m = code & 7;
  double v;
  if (e == 15 && m == 7)
    v = std::nan("");
  else if (e == 0)
    v = std::ldexp(static_cast<double>(m), -9);
  else
    v = std::ldexp(static_cast<double>(8 + m), e - 10);
  return (code & 0x80) ? -v : v;
}

struct E4m3Table {
  double value[256];
  E4m3Table() {
    for (int c = 0; c < 256; ++c) value[c] = e4m3_value(static_cast<uint8_t>(c));
  }
};
const E4m3Table kE4m3;

struct Problem {
  const float* rows;      // [M, K]
  const uint8_t* weight;  // [N, K] e4m3 codes
  const uint8_t* scales;  // [ceil(N/32), K/32] ue8m0
  float* out;             // [M, N]
  int64_t m, k, n;
};

// Outputs (rows [r0, r1), columns [n0, n1)), one at a time. Compiled for AVX2 and for any x86-64
// (chosen at load time); the same values either way.
__attribute__((target_clones("avx2", "default")))
void tile_generic(const Problem& p, int64_t r0, int64_t r1, int64_t n0, int64_t n1) {
  const int64_t blocks = p.k / kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = p.rows + r * p.k;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* w = p.weight + n * p.k;
      float acc = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // exact: any grouping of a block gives its sum
        for (int j = 0; j < kBlock; ++j)
          lanes[j % 8] += static_cast<double>(x[b * kBlock + j]) * kE4m3.value[w[b * kBlock + j]];
        double s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        float v = static_cast<float>(s * ced::ue8m0(p.scales[(n / kBlock) * blocks + b]));
        acc = b == 0 ? v : acc + v;
      }
      p.out[r * p.n + n] = acc;
    }
  }
}


// 16 e4m3 codes -> 16 f32, exactly: the code's low 7 bits are an f16's exponent and mantissa bits
// shifted by 7 (bias 15 instead of 7, so the f16 is the value times 2^-8, subnormals included), the
// sign moved to bit 15; 0x7F / 0xFF become NaN.
CED_AVX512 inline __m512 decode16(__m128i codes) {
  const __m256i h = _mm256_cvtepu8_epi16(codes);
  const __m256i magnitude = _mm256_and_si256(h, _mm256_set1_epi16(0x7F));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8);
  const __m256i half = _mm256_or_si256(sign, _mm256_slli_epi16(magnitude, 7));
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
  const __mmask16 nan = _mm256_cmpeq_epi16_mask(magnitude, _mm256_set1_epi16(0x7F));
  return _mm512_mask_blend_ps(nan, v, _mm512_set1_ps(std::nanf("")));
}

// Eight columns at a time: each block of the eight weight rows decoded once (as doubles), then every
// row of the tile against it; the eight block sums rounded to f32 together.
CED_AVX512 void tile_avx512(const Problem& p, int64_t r0, int64_t r1, int64_t n0, int64_t n1) {
  const int64_t blocks = p.k / kBlock;
  int64_t n = n0;
  for (; n + 8 <= n1; n += 8) {
    __m256 acc[kTile];
    for (int64_t b = 0; b < blocks; ++b) {
      __m512d w[8][4];
      alignas(64) double scale[8];
      for (int j = 0; j < 8; ++j) {
        const uint8_t* wb = p.weight + (n + j) * p.k + b * kBlock;
        const __m512 lo = decode16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb)));
        const __m512 hi = decode16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 16)));
        w[j][0] = _mm512_cvtps_pd(_mm512_castps512_ps256(lo));
        w[j][1] = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lo), 1)));
        w[j][2] = _mm512_cvtps_pd(_mm512_castps512_ps256(hi));
        w[j][3] = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(hi), 1)));
        scale[j] = ced::ue8m0(p.scales[((n + j) / kBlock) * blocks + b]);
      }
      const __m512d sc = _mm512_load_pd(scale);
      for (int64_t r = r0; r < r1; ++r) {
        const float* xb = p.rows + r * p.k + b * kBlock;
        __m512d x[4];
        for (int q = 0; q < 4; ++q) x[q] = _mm512_cvtps_pd(_mm256_loadu_ps(xb + 8 * q));
        __m512d sums[8];
        for (int j = 0; j < 8; ++j) {
          __m512d s = _mm512_mul_pd(x[0], w[j][0]);
          s = _mm512_fmadd_pd(x[1], w[j][1], s);
          s = _mm512_fmadd_pd(x[2], w[j][2], s);
          sums[j] = _mm512_fmadd_pd(x[3], w[j][3], s);
        }
        const __m256 v = _mm512_cvtpd_ps(_mm512_mul_pd(ced::sum_lanes_of_8(sums), sc));
        acc[r - r0] = b == 0 ? v : _mm256_add_ps(acc[r - r0], v);
      }
    }
    for (int64_t r = r0; r < r1; ++r) _mm256_storeu_ps(p.out + r * p.n + n, acc[r - r0]);
  }
  if (n < n1) tile_generic(p, r0, r1, n, n1);
}

using Tile = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t);

ffi::Error Fp8LinearRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::U8> weight,
                         ffi::Buffer<ffi::U8> scales, ffi::ResultBuffer<ffi::F32> out, int64_t portable) {
  auto rd = rows.dimensions();
  auto wd = weight.dimensions();
  auto sd = scales.dimensions();
  if (rd.size() != 2 || wd.size() != 2 || sd.size() != 2 || rd[1] != wd[1] || rd[1] % kBlock ||
      sd[0] != (wd[0] + kBlock - 1) / kBlock || sd[1] != rd[1] / kBlock)
    return ffi::Error::InvalidArgument(
        "fp8_linear_rows: rows [M, K], weight [N, K], scales [ceil(N/32), K/32] with K a multiple of 32 expected");
  const Problem p{rows.typed_data(), weight.typed_data(), scales.typed_data(), out->typed_data(), rd[0], rd[1],
                  wd[0]};
  static const bool avx512 = ced::has_avx512();
  const Tile tile = (avx512 && !portable) ? tile_avx512 : tile_generic;  // the tests compare both
  const int64_t chunks = (p.n + kChunk - 1) / kChunk, tiles = (p.m + kTile - 1) / kTile;
  ced::share_items(pool, chunks * tiles, [p, tile, chunks](int64_t item) {
    const int64_t t = item / chunks, c = item % chunks;
    tile(p, t * kTile, std::min(p.m, (t + 1) * kTile), c * kChunk, std::min(p.n, (c + 1) * kChunk));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CedFp8LinearRows, Fp8LinearRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("portable"));
