// FP4 expert rows on CPU, an XLA FFI custom call (pallas_kernels.grouped_matmul.kernel_cpu, issue 38).
//
// out[m, n] = row m of `rows` times expert ids[m]'s packed FP4 weight row n, in one fixed order:
// each 32-value block (one ue8m0 scale) is summed exactly (in double: the rows are FP8-dequantised,
// so every product and every partial sum of a block is exact there, whatever the order), rounded
// once to f32 with its scale applied, and the blocks are added in index order in f32. The jnp
// statement of the same order is pallas_kernels.grouped_matmul.reference.expert_rows_blocked. The rows
// are taken in expert order, in tiles of up to 16 rows of one expert that share one decode of each
// weight block; tiles and chunks of 64 columns are shared out over XLA's intra-op thread pool
// (shared_work.h); each output is one thread's.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_common.h"
#include "shared_work.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kBlock = 32;
// e2m1 codes 0..15: sign in bit 3; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (code 8 is +0 here, as
// pallas_kernels.formats.FP4_TABLE).
constexpr double kE2m1[16] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                              0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0};

struct Problem {
  const float* rows;       // [M, K]
  const int32_t* ids;      // [M]
  const uint8_t* packed;   // [E, N, K/2], even k in the low nibble
  const uint8_t* scales;   // [E, N, K/32], ue8m0
  float* out;              // [M, N]
  int64_t m, k, e, n;
};

// One output: the blocks of one weight row against one row (as doubles), in order. Compiled for AVX2
// and for any x86-64 (chosen at load time); the same values either way.
__attribute__((target_clones("avx2", "default")))
float dot_row_generic(const double* x, const uint8_t* w, const uint8_t* sc, int64_t blocks) {
  float acc = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // exact: any grouping of a block gives its sum
    const uint8_t* wb = w + b * (kBlock / 2);
    const double* xb = x + b * kBlock;
    for (int j = 0; j < kBlock / 2; ++j) {
      lanes[(2 * j) % 8] += xb[2 * j] * kE2m1[wb[j] & 15];
      lanes[(2 * j + 1) % 8] += xb[2 * j + 1] * kE2m1[wb[j] >> 4];
    }
    double s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    float v = static_cast<float>(s * ced::ue8m0(sc[b]));
    acc = b == 0 ? v : acc + v;
  }
  return acc;
}

// Columns [n0, n1) of one row, one column at a time.
void columns_generic(const double* x, const uint8_t* w, const uint8_t* sc, int64_t blocks, int64_t n0,
                     int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n) out[n] = dot_row_generic(x, w + n * blocks * 16, sc + n * blocks, blocks);
}


// A block of one column: 32 products as 8 double lanes (exact), FP4 codes decoded by permute.
CED_AVX512 inline __m512d block_avx512(const double* xb, const uint8_t* wb, __m512d lo, __m512d hi) {
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb));
  const __m128i even = _mm_and_si128(bytes, nibble);
  const __m128i odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
  const __m128i codes0 = _mm_unpacklo_epi8(even, odd);  // values 0..15 of the block, in order
  const __m128i codes1 = _mm_unpackhi_epi8(even, odd);  // values 16..31
  __m512d s = _mm512_mul_pd(_mm512_loadu_pd(xb), _mm512_permutex2var_pd(lo, _mm512_cvtepu8_epi64(codes0), hi));
  s = _mm512_fmadd_pd(_mm512_loadu_pd(xb + 8),
                      _mm512_permutex2var_pd(lo, _mm512_cvtepu8_epi64(_mm_srli_si128(codes0, 8)), hi), s);
  s = _mm512_fmadd_pd(_mm512_loadu_pd(xb + 16), _mm512_permutex2var_pd(lo, _mm512_cvtepu8_epi64(codes1), hi), s);
  s = _mm512_fmadd_pd(_mm512_loadu_pd(xb + 24),
                      _mm512_permutex2var_pd(lo, _mm512_cvtepu8_epi64(_mm_srli_si128(codes1, 8)), hi), s);
  return s;
}

// Columns [n0, n1) of one row: eight columns at a time, their block sums rounded to f32 together.
CED_AVX512 void columns_avx512(const double* x, const uint8_t* w, const uint8_t* sc, int64_t blocks, int64_t n0,
                               int64_t n1, float* out) {
  const __m512d lo = _mm512_loadu_pd(kE2m1), hi = _mm512_loadu_pd(kE2m1 + 8);
  const int64_t row_bytes = blocks * 16;
  int64_t n = n0;
  for (; n + 8 <= n1; n += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m512d sums[8];
      alignas(64) double scale[8];
      for (int j = 0; j < 8; ++j) {
        sums[j] = block_avx512(x + b * kBlock, w + (n + j) * row_bytes + b * 16, lo, hi);
        scale[j] = ced::ue8m0(sc[(n + j) * blocks + b]);
      }
      __m256 v = _mm512_cvtpd_ps(_mm512_mul_pd(ced::sum_lanes_of_8(sums), _mm512_load_pd(scale)));
      acc = b == 0 ? v : _mm256_add_ps(acc, v);
    }
    _mm256_storeu_ps(out + n, acc);
  }
  columns_generic(x, w, sc, blocks, n, n1, out);
}

constexpr int kTile = 16;  // rows of one expert that share one decode of its weight blocks

// Columns [n0, n1) of up to kTile rows of one expert (`xs` as doubles, `outs` their output rows): eight
// columns at a time, each block of the eight weight rows decoded once for all the rows; each row's
// eight block sums rounded to f32 together. Per row the same values as one row at a time, which a
// lone row takes (measured faster there: no decoded block kept for other rows).
CED_AVX512 void tile_avx512(const double* const* xs, int rows, const uint8_t* w, const uint8_t* sc, int64_t blocks,
                            int64_t n0, int64_t n1, float* const* outs) {
  if (rows == 1) return columns_avx512(xs[0], w, sc, blocks, n0, n1, outs[0]);  // decode fused into the dot
  const __m512d lo = _mm512_loadu_pd(kE2m1), hi = _mm512_loadu_pd(kE2m1 + 8);
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const int64_t row_bytes = blocks * 16;
  int64_t n = n0;
  for (; n + 8 <= n1; n += 8) {
    __m256 acc[kTile];
    for (int64_t b = 0; b < blocks; ++b) {
      __m512d wv[8][4];
      alignas(64) double scale[8];
      for (int j = 0; j < 8; ++j) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n + j) * row_bytes + b * 16));
        const __m128i even = _mm_and_si128(bytes, nibble);
        const __m128i odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
        const __m128i codes0 = _mm_unpacklo_epi8(even, odd), codes1 = _mm_unpackhi_epi8(even, odd);
        wv[j][0] = _mm512_permutex2var_pd(lo, _mm512_cvtepu8_epi64(codes0), hi);
        wv[j][1] = _mm512_permutex2var_pd(lo, _mm512_cvtepu8_epi64(_mm_srli_si128(codes0, 8)), hi);
        wv[j][2] = _mm512_permutex2var_pd(lo, _mm512_cvtepu8_epi64(codes1), hi);
        wv[j][3] = _mm512_permutex2var_pd(lo, _mm512_cvtepu8_epi64(_mm_srli_si128(codes1, 8)), hi);
        scale[j] = ced::ue8m0(sc[(n + j) * blocks + b]);
      }
      const __m512d sc8 = _mm512_load_pd(scale);
      for (int r = 0; r < rows; ++r) {
        const double* xb = xs[r] + b * kBlock;
        __m512d sums[8];
        for (int j = 0; j < 8; ++j) {
          __m512d s = _mm512_mul_pd(_mm512_loadu_pd(xb), wv[j][0]);
          s = _mm512_fmadd_pd(_mm512_loadu_pd(xb + 8), wv[j][1], s);
          s = _mm512_fmadd_pd(_mm512_loadu_pd(xb + 16), wv[j][2], s);
          sums[j] = _mm512_fmadd_pd(_mm512_loadu_pd(xb + 24), wv[j][3], s);
        }
        const __m256 v = _mm512_cvtpd_ps(_mm512_mul_pd(ced::sum_lanes_of_8(sums), sc8));
        acc[r] = b == 0 ? v : _mm256_add_ps(acc[r], v);
      }
    }
    for (int r = 0; r < rows; ++r) _mm256_storeu_ps(outs[r] + n, acc[r]);
  }
  for (int r = 0; r < rows; ++r) columns_generic(xs[r], w, sc, blocks, n, n1, outs[r]);
}

// The same, one row and one column at a time (the portable loop).
void tile_generic(const double* const* xs, int rows, const uint8_t* w, const uint8_t* sc, int64_t blocks,
                  int64_t n0, int64_t n1, float* const* outs) {
  for (int r = 0; r < rows; ++r) columns_generic(xs[r], w, sc, blocks, n0, n1, outs[r]);
}

using Tile = void (*)(const double* const*, int, const uint8_t*, const uint8_t*, int64_t, int64_t, int64_t,
                      float* const*);

// Work items: (tile of up to kTile rows of one expert, chunk of kChunk columns).
constexpr int64_t kChunk = 64;

ffi::Error Fp4ExpertRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::S32> ids,
                         ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::U8> scales, ffi::ResultBuffer<ffi::F32> out,
                         int64_t portable) {
  auto rd = rows.dimensions();
  auto wd = packed.dimensions();
  if (rd.size() != 2 || wd.size() != 3 || rd[1] % kBlock || wd[2] * 2 != rd[1] || ids.element_count() != rd[0])
    return ffi::Error::InvalidArgument("fp4_expert_rows: rows [M, K], ids [M], packed [E, N, K/2] expected");
  Problem p{rows.typed_data(), ids.typed_data(), packed.typed_data(), scales.typed_data(), out->typed_data(),
            rd[0], rd[1], wd[0], wd[1]};
  for (int64_t m = 0; m < p.m; ++m)
    if (p.ids[m] < 0 || p.ids[m] >= p.e)
      return ffi::Error::InvalidArgument("fp4_expert_rows: expert id " + std::to_string(p.ids[m]) + " of row " +
                                         std::to_string(m) + " is outside 0.." + std::to_string(p.e - 1));
  static const bool avx512 = ced::has_avx512();
  const Tile tile = (avx512 && !portable) ? tile_avx512 : tile_generic;  // the tests compare both
  // The rows in expert order (stable), cut into tiles of one expert.
  std::vector<int64_t> order(p.m);
  for (int64_t m = 0; m < p.m; ++m) order[m] = m;
  std::stable_sort(order.begin(), order.end(), [&p](int64_t a, int64_t b) { return p.ids[a] < p.ids[b]; });
  std::vector<std::pair<int64_t, int>> tiles;  // (first position in `order`, rows)
  for (int64_t i = 0; i < p.m;) {
    int rows = 1;
    while (i + rows < p.m && rows < kTile && p.ids[order[i + rows]] == p.ids[order[i]]) ++rows;
    tiles.emplace_back(i, rows);
    i += rows;
  }
  const int64_t blocks = p.k / kBlock, chunks = (p.n + kChunk - 1) / kChunk;
  const std::vector<int64_t>* sorted = &order;
  const std::vector<std::pair<int64_t, int>>* cut = &tiles;
  ced::share_items(pool, static_cast<int64_t>(tiles.size()) * chunks,
                   [p, tile, blocks, chunks, sorted, cut](int64_t item) {
                     const auto [first, rows] = (*cut)[item / chunks];
                     const int64_t c = item % chunks;
                     thread_local std::vector<double> x;
                     x.resize(kTile * p.k);
                     const double* xs[kTile];
                     float* outs[kTile];
                     for (int r = 0; r < rows; ++r) {
                       const int64_t m = (*sorted)[first + r];
                       std::copy(p.rows + m * p.k, p.rows + (m + 1) * p.k, x.begin() + r * p.k);
                       xs[r] = x.data() + r * p.k;
                       outs[r] = p.out + m * p.n;
                     }
                     const int64_t id = p.ids[(*sorted)[first]];
                     tile(xs, rows, p.packed + id * p.n * blocks * 16, p.scales + id * p.n * blocks, blocks,
                          c * kChunk, std::min(p.n, (c + 1) * kChunk), outs);
                   });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CedFp4ExpertRows, Fp4ExpertRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("portable"));

// The widest vector loops this CPU runs: 512 (AVX-512), 256 (AVX2) or 0 (the portable build).
extern "C" int ced_cpu_kernels_isa() {
  if (ced::has_avx512()) return 512;
  return __builtin_cpu_supports("avx2") ? 256 : 0;
}
