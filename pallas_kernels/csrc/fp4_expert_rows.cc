// FP4 expert rows on CPU, an XLA FFI custom call (pallas_kernels.grouped_matmul.kernel_cpu, issue 38).
//
// out[m, n] = row m of `rows` times expert ids[m]'s dequantised FP4 weight row n, in XLA:CPU's order
// for the same f32 product (cpu_common.h, "the order of sums"): the weight value is the e2m1 value
// times its ue8m0 scale in f32, exactly as the XLA path dequantises it, and each output adds its
// products one by one in index order within runs of 512 values. The rows are taken in expert order,
// in tiles of up to 16 rows of one expert that share each decoded weight value; tiles and chunks of
// 64 columns are shared out over XLA's intra-op thread pool (shared_work.h); each output is one
// thread's, its order the same whatever the tile.
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
alignas(64) constexpr float kE2m1[16] = {0.0f, 0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                         0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

struct Problem {
  const float* rows;       // [M, K]
  const int32_t* ids;      // [M]
  const uint8_t* packed;   // [E, N, K/2], even k in the low nibble
  const uint8_t* scales;   // [E, N, K/32], ue8m0
  float* out;              // [M, N]
  int64_t m, k, e, n;
};

// One expert's weight and the rows of one tile.
struct Tile {
  const float* const* xs;  // rows (each [K])
  float* const* outs;      // their output rows (each [N])
  int rows;
  const uint8_t* w;        // [N, K/2]
  const uint8_t* sc;       // [N, K/32]
  int64_t k, n;
};

// Columns [n0, n1) of every row of the tile, one output at a time (the portable loop). Compiled
// for AVX2 and for any x86-64 (chosen at load time); the same values either way.
__attribute__((target_clones("avx2", "default")))
void columns_generic(const Tile& t, int64_t n0, int64_t n1) {
  const int64_t blocks = t.k / kBlock;
  for (int r = 0; r < t.rows; ++r)
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* w = t.w + n * blocks * 16;
      const uint8_t* sc = t.sc + n * blocks;
      float total = 0.0f;
      for (int64_t start = 0; start < t.k; start += ced::kRun) {
        float acc = 0.0f;
        for (int64_t k = start; k < std::min(t.k, start + ced::kRun); ++k) {
          const int code = (k & 1) ? w[k / 2] >> 4 : w[k / 2] & 15;
          acc = std::fma(kE2m1[code] * ced::ue8m0_f32(sc[k / kBlock]), t.xs[r][k], acc);
        }
        total = start == 0 ? acc : total + acc;
      }
      t.outs[r][n] = total;
    }
}

// The scales of block b of 16 columns (their scale rows at `offset` bytes from t.sc) as f32, as
// ced::ue8m0_f32 reads them: four bytes gathered from each row, the first one kept. A lane whose four
// bytes would run past the expert's scales reads its one byte alone.
CED_AVX512 inline __m512 scales_avx512(const Tile& t, __m512i offset, __mmask16 live, int64_t b) {
  const __m512i at = _mm512_add_epi32(offset, _mm512_set1_epi32(static_cast<int>(b)));
  const int64_t size = t.n * (t.k / kBlock);
  const __mmask16 whole = _mm512_mask_cmplt_epi32_mask(live, at, _mm512_set1_epi32(static_cast<int>(size - 3)));
  __m512i bytes = _mm512_and_si512(_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), whole, at, t.sc, 1),
                                   _mm512_set1_epi32(0xFF));
  if (live & ~whole) {
    alignas(64) int32_t lanes[16], at_lanes[16];
    _mm512_store_si512(lanes, bytes);
    _mm512_store_si512(at_lanes, at);
    for (int j = 0; j < 16; ++j)
      if ((live & ~whole) >> j & 1) lanes[j] = t.sc[at_lanes[j]];
    bytes = _mm512_load_si512(lanes);
  }
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(bytes, _mm512_set1_epi32(255));
  const __m512i bits = _mm512_mask_or_epi32(_mm512_slli_epi32(bytes, 23), nan, _mm512_slli_epi32(bytes, 23),
                                            _mm512_set1_epi32(1 << 22));
  return _mm512_castsi512_ps(bits);
}

// G groups of 16 columns from n (lanes past n1 masked off) for R rows of the tile: lane j of group g
// is column n + 16 g + j, its weight bytes gathered 16 values at a time and decoded by permute.
constexpr int64_t kPrefetch = 8;

template <int G, int R>
CED_AVX512 void panel_avx512(const Tile& t, int r0, int64_t n, int64_t n1) {
  const __m512 table = _mm512_load_ps(kE2m1);
  const int64_t blocks = t.k / kBlock, row_bytes = blocks * 16;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __mmask16 live[G];
  __m512i offset[G], scale_offset[G];  // each lane's weight row and scale row, in bytes from t.w and t.sc
  __m256i offset_lo[G], offset_hi[G];  // lanes 0-7 and 8-15 of offset
  for (int g = 0; g < G; ++g) {
    const __m512i col = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(n + 16 * g)));
    live[g] = _mm512_cmplt_epi32_mask(col, _mm512_set1_epi32(static_cast<int>(n1)));
    offset[g] = _mm512_mullo_epi32(col, _mm512_set1_epi32(static_cast<int>(row_bytes)));
    scale_offset[g] = _mm512_mullo_epi32(col, _mm512_set1_epi32(static_cast<int>(blocks)));
    offset_lo[g] = _mm512_castsi512_si256(offset[g]);
    offset_hi[g] = _mm512_extracti64x4_epi64(offset[g], 1);
  }
  const __m512i even_dwords = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd_dwords = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int64_t start = 0; start < t.k; start += ced::kRun) {
    __m512 acc[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
    const int64_t end = std::min(t.k, start + ced::kRun);
    for (int64_t b = start / kBlock; b < end / kBlock; ++b) {
      // Sixteen rows read side by side are more streams than the hardware prefetcher follows: each
      // row's cache line kPrefetch blocks ahead is asked for once per line (four blocks).
      if (b % 4 == 0 && b + kPrefetch < blocks)
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < 16 && n + 16 * g + j < n1; ++j)
            _mm_prefetch(reinterpret_cast<const char*>(t.w + (n + 16 * g + j) * row_bytes + (b + kPrefetch) * 16),
                         _MM_HINT_T0);
      __m512 scale[G];
      for (int g = 0; g < G; ++g) scale[g] = scales_avx512(t, scale_offset[g], live[g], b);
      for (int half = 0; half < 2; ++half) {  // eight bytes (16 values) of each lane's block at a time
        __m512i even[G], odd[G];  // lane j: bytes 0-3 / 4-7 of those eight
        for (int g = 0; g < G; ++g) {
          // Eight-byte gathers read the bytes with half as many elements as four-byte ones.
          const __m256i at = _mm256_set1_epi32(static_cast<int>(b * 16 + half * 8));
          const __m512i lo = _mm512_mask_i32gather_epi64(_mm512_setzero_si512(), static_cast<__mmask8>(live[g]),
                                                         _mm256_add_epi32(offset_lo[g], at), t.w, 1);
          const __m512i hi = _mm512_mask_i32gather_epi64(_mm512_setzero_si512(), static_cast<__mmask8>(live[g] >> 8),
                                                         _mm256_add_epi32(offset_hi[g], at), t.w, 1);
          even[g] = _mm512_permutex2var_epi32(lo, even_dwords, hi);
          odd[g] = _mm512_permutex2var_epi32(lo, odd_dwords, hi);
        }
        for (int q = 0; q < 2; ++q) {
          for (int v = 0; v < 8; ++v) {
            const int64_t k = b * kBlock + (half * 2 + q) * 8 + v;
            for (int g = 0; g < G; ++g) {
              // The permute reads the low four bits of each lane: value v's nibble after the shift.
              const __m512i bytes = q ? odd[g] : even[g];
              const __m512 w = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4 * v), table), scale[g]);
              for (int r = 0; r < R; ++r) acc[r][g] = _mm512_fmadd_ps(w, _mm512_set1_ps(t.xs[r0 + r][k]), acc[r][g]);
            }
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) {
        float* o = t.outs[r0 + r] + n + 16 * g;
        const __m512 sum = start == 0 ? acc[r][g] : _mm512_add_ps(_mm512_maskz_loadu_ps(live[g], o), acc[r][g]);
        _mm512_mask_storeu_ps(o, live[g], sum);
      }
  }
}

// Columns [n0, n1) of every row of the tile: a lone row four groups of 16 columns at a time (four
// independent chains of adds), several rows up to eight at a time two groups at a time.
CED_AVX512 void columns_avx512(const Tile& t, int64_t n0, int64_t n1) {
  if (t.rows == 1) {
    for (int64_t n = n0; n < n1; n += 64) panel_avx512<4, 1>(t, 0, n, n1);
    return;
  }
  for (int r0 = 0; r0 < t.rows; r0 += 8)
    ced::with_row_count(t.rows - r0, [&](auto rows) {
      for (int64_t n = n0; n < n1; n += 32) panel_avx512<2, decltype(rows)::value>(t, r0, n, n1);
    });
}

using Columns = void (*)(const Tile&, int64_t, int64_t);

constexpr int kTile = 16;       // rows of one expert that share each decoded weight value
constexpr int64_t kChunk = 64;  // columns of one work item

ffi::Error Fp4ExpertRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::S32> ids,
                         ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::U8> scales, ffi::ResultBuffer<ffi::F32> out,
                         int64_t portable) {
  auto rd = rows.dimensions();
  auto wd = packed.dimensions();
  if (rd.size() != 2 || wd.size() != 3 || rd[1] % kBlock || wd[2] * 2 != rd[1] || ids.element_count() != rd[0])
    return ffi::Error::InvalidArgument("fp4_expert_rows: rows [M, K], ids [M], packed [E, N, K/2] expected");
  if (wd[1] * wd[2] >= (int64_t{1} << 31))
    return ffi::Error::InvalidArgument("fp4_expert_rows: one expert's packed weight must be under 2 GiB");
  Problem p{rows.typed_data(), ids.typed_data(), packed.typed_data(), scales.typed_data(), out->typed_data(),
            rd[0], rd[1], wd[0], wd[1]};
  for (int64_t m = 0; m < p.m; ++m)
    if (p.ids[m] < 0 || p.ids[m] >= p.e)
      return ffi::Error::InvalidArgument("fp4_expert_rows: expert id " + std::to_string(p.ids[m]) + " of row " +
                                         std::to_string(m) + " is outside 0.." + std::to_string(p.e - 1));
  static const bool avx512 = ced::has_avx512();
  const Columns columns = (avx512 && !portable) ? columns_avx512 : columns_generic;  // the tests compare both
  // The rows in expert order (stable), cut into tiles of one expert.
  std::vector<int64_t> order(p.m);
  for (int64_t m = 0; m < p.m; ++m) order[m] = m;
  std::stable_sort(order.begin(), order.end(), [&p](int64_t a, int64_t b) { return p.ids[a] < p.ids[b]; });
  std::vector<std::pair<int64_t, int>> tiles;  // (first position in `order`, rows)
  for (int64_t i = 0; i < p.m;) {
    int n = 1;
    while (i + n < p.m && n < kTile && p.ids[order[i + n]] == p.ids[order[i]]) ++n;
    tiles.emplace_back(i, n);
    i += n;
  }
  const int64_t blocks = p.k / kBlock, chunks = (p.n + kChunk - 1) / kChunk;
  const std::vector<int64_t>* sorted = &order;
  const std::vector<std::pair<int64_t, int>>* cut = &tiles;
  ced::share_items(pool, static_cast<int64_t>(tiles.size()) * chunks,
                   [p, columns, blocks, chunks, sorted, cut](int64_t item) {
                     const auto [first, n_rows] = (*cut)[item / chunks];
                     const int64_t c = item % chunks;
                     const float* xs[kTile];
                     float* outs[kTile];
                     for (int r = 0; r < n_rows; ++r) {
                       const int64_t m = (*sorted)[first + r];
                       xs[r] = p.rows + m * p.k;
                       outs[r] = p.out + m * p.n;
                     }
                     const int64_t id = p.ids[(*sorted)[first]];
                     const Tile t{xs, outs, n_rows, p.packed + id * p.n * blocks * 16, p.scales + id * p.n * blocks,
                                  p.k, p.n};
                     columns(t, c * kChunk, std::min(p.n, (c + 1) * kChunk));
                   },
                   p.m * p.n * p.k);
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
