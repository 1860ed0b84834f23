// The FP8 block-scaled linear on CPU, an XLA FFI custom call (pallas_kernels.fp8_linear.kernel_cpu,
// issue 38): out[m, n] = rows[m] . dequant(weight)[n], the e4m3 weight decoded inside the dot.
//
// The XLA path's values bit for bit: the weight value is the e4m3 value times its ue8m0 scale (one
// per 32 x 32 block) in f32, as the XLA path dequantises it, and each output adds its products in
// XLA:CPU's order (cpu_common.h, "the order of sums"). Work items are (tile of rows, chunk of
// columns); a weight value is decoded once for up to eight rows.
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
float e4m3_value(uint8_t code) {
  const int e = (code >> 3) & 15, m = code & 7;
  float v;
  if (e == 15 && m == 7)
    v = std::nanf("");
  else if (e == 0)
    v = std::ldexp(static_cast<float>(m), -9);
  else
    v = std::ldexp(static_cast<float>(8 + m), e - 10);
  return (code & 0x80) ? -v : v;
}

struct E4m3Table {
  float value[256];
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
      const uint8_t* sc = p.scales + (n / kBlock) * blocks;
      float total = 0.0f;
      for (int64_t start = 0; start < p.k; start += ced::kRun) {
        float acc = 0.0f;
        for (int64_t k = start; k < std::min(p.k, start + ced::kRun); ++k)
          acc = std::fma(kE4m3.value[w[k]] * ced::ue8m0_f32(sc[k / kBlock]), x[k], acc);
        total = start == 0 ? acc : total + acc;
      }
      p.out[r * p.n + n] = total;
    }
  }
}

// G groups of 16 columns from n (a multiple of 16, so a group's columns share their scales; lanes past
// n1 masked off) for R rows from r: lane j of group g is column n + 16 g + j, its weight codes gathered
// eight at a time. A code's low 7 bits shifted by 7 are an f16 whose value is the e4m3 value times 2^-8
// (bias 15 instead of 7, subnormals included); times 2^8 times the scale it is the XLA path's
// dequantised value (one rounding either way, to the same real number). 0x7F / 0xFF are NaN.
template <int G, int R>
CED_AVX512 void panel_avx512(const Problem& p, int64_t r, int64_t n, int64_t n1) {
  const int64_t blocks = p.k / kBlock;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i magnitude_bits = _mm512_set1_epi16(0x3F80), sign_bit = _mm512_set1_epi16(static_cast<short>(0x8000));
  const __m512i even_dwords = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd_dwords = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  // 16-bit lane 2j holds lane j's first code of a pair, 2j + 1 its second: the firsts to words 0-15.
  const __m512i by_code = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 30, 28, 26, 24,
                                           22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  __mmask16 live[G];
  __m512i offset[G];  // each lane's weight row, in bytes from p.weight
  __m256i offset_lo[G], offset_hi[G];  // lanes 0-7 and 8-15 of offset
  for (int g = 0; g < G; ++g) {
    const __m512i col = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(n + 16 * g)));
    live[g] = _mm512_cmplt_epi32_mask(col, _mm512_set1_epi32(static_cast<int>(n1)));
    offset[g] = _mm512_mullo_epi32(col, _mm512_set1_epi32(static_cast<int>(p.k)));
    offset_lo[g] = _mm512_castsi512_si256(offset[g]);
    offset_hi[g] = _mm512_extracti64x4_epi64(offset[g], 1);
  }
  const float* x = p.rows + r * p.k;
  for (int64_t start = 0; start < p.k; start += ced::kRun) {
    __m512 acc[R][G];
    for (int i = 0; i < R; ++i)
      for (int g = 0; g < G; ++g) acc[i][g] = _mm512_setzero_ps();
    const int64_t end = std::min(p.k, start + ced::kRun);
    for (int64_t b = start / kBlock; b < end / kBlock; ++b) {
      __m512 scale[G], plain[G];  // 2^8 times the scale, or 2^8 and the scale apart where that overflows
      bool split[G];
      for (int g = 0; g < G; ++g) {
        const float s = n + 16 * g < n1 ? ced::ue8m0_f32(p.scales[((n + 16 * g) / kBlock) * blocks + b]) : 0.0f;
        split[g] = !std::isfinite(256.0f * s) && std::isfinite(s);
        scale[g] = _mm512_set1_ps(split[g] ? s : 256.0f * s);
        plain[g] = _mm512_set1_ps(split[g] ? 256.0f : 1.0f);
      }
      for (int q = 0; q < kBlock / 8; ++q) {  // eight codes of each lane at a time
        __m512i words[G][2];  // lane j: codes 0-3 / 4-7 of those eight
        for (int g = 0; g < G; ++g) {
          // Eight-byte gathers read the codes with half as many elements as four-byte ones.
          const __m256i at = _mm256_set1_epi32(static_cast<int>(b * kBlock + q * 8));
          const __m512i lo = _mm512_mask_i32gather_epi64(_mm512_setzero_si512(), static_cast<__mmask8>(live[g]),
                                                         _mm256_add_epi32(offset_lo[g], at), p.weight, 1);
          const __m512i hi = _mm512_mask_i32gather_epi64(_mm512_setzero_si512(), static_cast<__mmask8>(live[g] >> 8),
                                                         _mm256_add_epi32(offset_hi[g], at), p.weight, 1);
          words[g][0] = _mm512_permutex2var_epi32(lo, even_dwords, hi);
          words[g][1] = _mm512_permutex2var_epi32(lo, odd_dwords, hi);
        }
        for (int h = 0; h < 2; ++h) {
          __m512 w[G][4];  // codes 4h .. 4h+3 of each lane, decoded and scaled
          for (int g = 0; g < G; ++g) {
            const __m512i d = words[g][h];
            // In 16-bit lanes (codes 0 and 2 of a lane low, 1 and 3 high): each code as its f16, then
            // the lanes regrouped so that each half of a register holds one code of all 16 columns.
            const __m512i low = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(d, 7), magnitude_bits),
                                                _mm512_and_si512(_mm512_slli_epi16(d, 8), sign_bit));
            const __m512i high = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(d, 1), magnitude_bits),
                                                 _mm512_and_si512(d, sign_bit));
            const __m512i h02 = _mm512_permutexvar_epi16(by_code, low), h13 = _mm512_permutexvar_epi16(by_code, high);
            w[g][0] = _mm512_cvtph_ps(_mm512_castsi512_si256(h02));
            w[g][1] = _mm512_cvtph_ps(_mm512_castsi512_si256(h13));
            w[g][2] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h02, 1));
            w[g][3] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h13, 1));
            for (int v = 0; v < 4; ++v) {
              if (split[g]) w[g][v] = _mm512_mul_ps(w[g][v], plain[g]);
              w[g][v] = _mm512_mul_ps(w[g][v], scale[g]);
            }
            const __mmask64 nan = _mm512_cmpeq_epi8_mask(_mm512_and_si512(d, _mm512_set1_epi8(0x7F)), _mm512_set1_epi8(0x7F));
            if (nan)  // rare: a NaN code among these
              for (int v = 0; v < 4; ++v) {
                const __m512i code = _mm512_and_si512(_mm512_srli_epi32(d, 8 * v), _mm512_set1_epi32(0x7F));
                const __mmask16 lanes = _mm512_cmpeq_epi32_mask(code, _mm512_set1_epi32(0x7F));
                w[g][v] = _mm512_mask_blend_ps(lanes, w[g][v], _mm512_set1_ps(std::nanf("")));
              }
          }
          for (int v = 0; v < 4; ++v) {
            const int64_t k = b * kBlock + q * 8 + h * 4 + v;
            for (int g = 0; g < G; ++g)
              for (int i = 0; i < R; ++i) acc[i][g] = _mm512_fmadd_ps(w[g][v], _mm512_set1_ps(x[i * p.k + k]), acc[i][g]);
          }
        }
      }
    }
    for (int i = 0; i < R; ++i)
      for (int g = 0; g < G; ++g) {
        float* o = p.out + (r + i) * p.n + n + 16 * g;
        const __m512 sum = start == 0 ? acc[i][g] : _mm512_add_ps(_mm512_maskz_loadu_ps(live[g], o), acc[i][g]);
        _mm512_mask_storeu_ps(o, live[g], sum);
      }
  }
}

// A lone row four groups of 16 columns at a time (four independent chains of adds); more rows up to
// eight at a time, two groups at a time.
CED_AVX512 void tile_avx512(const Problem& p, int64_t r0, int64_t r1, int64_t n0, int64_t n1) {
  if (r1 - r0 == 1) {
    for (int64_t n = n0; n < n1; n += 64) panel_avx512<4, 1>(p, r0, n, n1);
    return;
  }
  for (int64_t r = r0; r < r1; r += 8)
    ced::with_row_count(r1 - r, [&](auto rows) {
      for (int64_t n = n0; n < n1; n += 32) panel_avx512<2, decltype(rows)::value>(p, r, n, n1);
    });
}

using Tile = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t);

// The weight comes as float8_e4m3fn or as its uint8 codes, read the same: a bitcast to uint8 in the
// caller would make XLA:CPU copy the whole weight on every call.
ffi::Error Fp8LinearRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::AnyBuffer weight,
                         ffi::Buffer<ffi::U8> scales, ffi::ResultBuffer<ffi::F32> out, int64_t portable) {
  if (weight.element_type() != ffi::DataType::U8 && weight.element_type() != ffi::DataType::F8E4M3FN)
    return ffi::Error::InvalidArgument("fp8_linear_rows: weight must be float8_e4m3fn or uint8");
  auto rd = rows.dimensions();
  auto wd = weight.dimensions();
  auto sd = scales.dimensions();
  if (rd.size() != 2 || wd.size() != 2 || sd.size() != 2 || rd[1] != wd[1] || rd[1] % kBlock ||
      sd[0] != (wd[0] + kBlock - 1) / kBlock || sd[1] != rd[1] / kBlock)
    return ffi::Error::InvalidArgument(
        "fp8_linear_rows: rows [M, K], weight [N, K], scales [ceil(N/32), K/32] with K a multiple of 32 expected");
  if (wd[0] * wd[1] >= (int64_t{1} << 31))
    return ffi::Error::InvalidArgument("fp8_linear_rows: the weight must be under 2 GiB");
  const Problem p{rows.typed_data(), static_cast<const uint8_t*>(weight.untyped_data()), scales.typed_data(),
                  out->typed_data(), rd[0], rd[1], wd[0]};
  static const bool avx512 = ced::has_avx512();
  const Tile tile = (avx512 && !portable) ? tile_avx512 : tile_generic;  // the tests compare both
  const int64_t chunks = (p.n + kChunk - 1) / kChunk, tiles = (p.m + kTile - 1) / kTile;
  ced::share_items(pool, chunks * tiles, [p, tile, chunks](int64_t item) {
    const int64_t t = item / chunks, c = item % chunks;
    tile(p, t * kTile, std::min(p.m, (t + 1) * kTile), c * kChunk, std::min(p.n, (c + 1) * kChunk));
  }, p.m * p.n * p.k);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CedFp8LinearRows, Fp8LinearRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("portable"));
