// The indexer's scores over the paged FP4 index keys on CPU, an XLA FFI custom call
// (pallas_kernels.indexer.kernel_cpu, issue 38): each key read packed from its page through the page
// table (Dk/2 bytes of e2m1 codes, Dk/32 ue8m0 scales), never unpacked into a buffer.
//
// score[b, t, c] = bf16(sum_h bf16(relu(bf16(q[b, t, h] . key_c)) * w[b, t, h])) for c < n_visible[b, t],
// else -inf; the heads added in order 0..I-1 in f32 (the contract of pallas_kernels.indexer.common).
// The dot: each 32-value block summed in f32 (exact: FP4 queries times FP4 keys have products of at
// most 4 significant bits, and a block's sum fits in 24), the blocks added in order. Page ids are
// clipped into the buffer, as the jnp reference reads them. Work items are (row, chunk of pages).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_common.h"
#include "shared_work.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kBlock = 32;
constexpr int64_t kPagesPerItem = 16;
constexpr float kE2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                             0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline float round_bf16(float x) {  // pallas_kernels.formats.round_bf16, on the bit pattern
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

struct Problem {
  const float* q;         // [B, T, I, Dk]
  const float* w;         // [B, T, I]
  const uint8_t* pages;   // [P, S, Dk/2 + Dk/32]
  const int32_t* table;   // [B, n]
  const int32_t* visible; // [B, T]
  float* out;             // [B, T, n * S]
  int64_t b, t, heads, dk, num_pages, slots, width;
};

// One key's dot with one query row: 32-value blocks, each exact, added in order.
inline float dot_generic(const float* q, const float* key, int64_t dk) {
  float total = 0.0f;
  for (int64_t blk = 0; blk < dk / kBlock; ++blk) {
    float s = 0.0f;  // exact in any order
    for (int j = 0; j < kBlock; ++j) s += q[blk * kBlock + j] * key[blk * kBlock + j];
    total = blk == 0 ? s : total + s;
  }
  return total;
}


CED_AVX512 inline __m512 round_bf16_16(__m512 x) {  // round_bf16 in each lane
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Lane j of the result: the sum of v[j]'s sixteen lanes (any order: the sums are exact).
CED_AVX512 inline __m512 sum_lanes_of_16(const __m512* v) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // y[i]'s 128-bit lane g holds slots 4i..4i+3 summed over the values of lane group g.
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

// One slot's key, decoded: 32 e2m1 codes (16 bytes, even value in the low nibble) per scale.
CED_AVX512 inline void decode_key(const uint8_t* e, int64_t dk, float* key) {
  const __m512 table = _mm512_loadu_ps(kE2m1);
  const __m128i nibble = _mm_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < dk / kBlock; ++blk) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(e + blk * 16));
    const __m128i even = _mm_and_si128(bytes, nibble), odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    const __m512 scale = _mm512_set1_ps(ced::ue8m0_f32(e[dk / 2 + blk]));
    const __m512i lo = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(even, odd));
    const __m512i hi = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(even, odd));
    _mm512_storeu_ps(key + blk * kBlock, _mm512_mul_ps(_mm512_permutexvar_ps(lo, table), scale));
    _mm512_storeu_ps(key + blk * kBlock + 16, _mm512_mul_ps(_mm512_permutexvar_ps(hi, table), scale));
  }
}

// Sixteen consecutive slots [c0, c0 + 16) of one row at once, a slot per result lane: each block's
// sixteen dots summed across lanes together (exact), the blocks in order, and the same roundings as
// score_pages_generic. Slots at or past `end` are not read.
CED_AVX512 void score16(const Problem& p, int64_t row, int64_t c0, int64_t end, float* keys) {
  const int64_t entry = p.dk / 2 + p.dk / kBlock, n = p.width / p.slots;
  const int lanes = static_cast<int>(std::min<int64_t>(16, end - c0));
  for (int l = 0; l < 16; ++l) {
    if (l >= lanes) {
      std::fill(keys + l * p.dk, keys + (l + 1) * p.dk, 0.0f);
      continue;
    }
    const int64_t c = c0 + l, j = c / p.slots;
    const int64_t page = std::clamp<int64_t>(p.table[row * n + j], 0, p.num_pages - 1);
    decode_key(p.pages + (page * p.slots + c % p.slots) * entry, p.dk, keys + l * p.dk);
  }
  const __mmask16 store = static_cast<__mmask16>((1u << lanes) - 1);
  const __m512i slot = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(c0)),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  for (int64_t t = 0; t < p.t; ++t) {
    const float* q = p.q + (row * p.t + t) * p.heads * p.dk;
    const float* w = p.w + (row * p.t + t) * p.heads;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t h = 0; h < p.heads; ++h) {
      __m512 total = _mm512_setzero_ps();
      for (int64_t blk = 0; blk < p.dk / kBlock; ++blk) {
        const float* qb = q + h * p.dk + blk * kBlock;
        const __m512 q_lo = _mm512_loadu_ps(qb), q_hi = _mm512_loadu_ps(qb + 16);
        __m512 part[16];
        for (int l = 0; l < 16; ++l) {
          const float* kb = keys + l * p.dk + blk * kBlock;
          part[l] = _mm512_fmadd_ps(q_hi, _mm512_loadu_ps(kb + 16), _mm512_mul_ps(q_lo, _mm512_loadu_ps(kb)));
        }
        const __m512 sum = sum_lanes_of_16(part);
        total = blk == 0 ? sum : _mm512_add_ps(total, sum);
      }
      const __m512 relu = _mm512_max_ps(round_bf16_16(total), _mm512_setzero_ps());
      const __m512 v = round_bf16_16(_mm512_mul_ps(relu, _mm512_set1_ps(w[h])));
      acc = h == 0 ? v : _mm512_add_ps(acc, v);
    }
    const __mmask16 seen = _mm512_cmplt_epi32_mask(slot, _mm512_set1_epi32(p.visible[row * p.t + t]));
    const __m512 score = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                              round_bf16_16(acc));
    _mm512_mask_storeu_ps(p.out + (row * p.t + t) * p.width + c0, store, score);
  }
}

// Pages [first, last) of one row's table, a slot and a query at a time. Compiled for AVX2 and for any
// x86-64 (chosen at load time); the same values either way.
__attribute__((target_clones("avx2", "default")))
void score_pages_generic(const Problem& p, int64_t row, int64_t first, int64_t last) {
  const int64_t entry = p.dk / 2 + p.dk / kBlock;
  int32_t limit = 0;  // no query of the row sees a slot at or past it
  for (int64_t t = 0; t < p.t; ++t) limit = std::max(limit, p.visible[row * p.t + t]);
  thread_local std::vector<float> key;
  key.resize(p.dk);
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t j = first; j < last; ++j) {
    const int64_t page = std::clamp<int64_t>(p.table[row * (p.width / p.slots) + j], 0, p.num_pages - 1);
    for (int64_t s = 0; s < p.slots; ++s) {
      const int64_t c = j * p.slots + s;
      if (c >= limit) {
        for (int64_t t = 0; t < p.t; ++t) p.out[(row * p.t + t) * p.width + c] = minus_inf;
        continue;
      }
      const uint8_t* e = p.pages + (page * p.slots + s) * entry;
      for (int64_t i = 0; i < p.dk / 2; ++i) {
        const float scale = ced::ue8m0_f32(e[p.dk / 2 + (2 * i) / kBlock]);
        key[2 * i] = kE2m1[e[i] & 15] * scale;
        key[2 * i + 1] = kE2m1[e[i] >> 4] * scale;
      }
      for (int64_t t = 0; t < p.t; ++t) {
        float* o = p.out + (row * p.t + t) * p.width + c;
        if (c >= p.visible[row * p.t + t]) {
          *o = minus_inf;
          continue;
        }
        const float* q = p.q + (row * p.t + t) * p.heads * p.dk;
        const float* w = p.w + (row * p.t + t) * p.heads;
        float total = 0.0f;
        for (int64_t h = 0; h < p.heads; ++h) {
          const float d = round_bf16(dot_generic(q + h * p.dk, key.data(), p.dk));
          const float v = round_bf16(std::max(d, 0.0f) * w[h]);
          total = h == 0 ? v : total + v;
        }
        *o = round_bf16(total);
      }
    }
  }
}

ffi::Error IndexScores(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> w,
                       ffi::Buffer<ffi::U8> pages, ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> visible,
                       ffi::ResultBuffer<ffi::F32> out, int64_t portable) {
  auto qd = q.dimensions();
  auto pd = pages.dimensions();
  auto td = table.dimensions();
  if (qd.size() != 4 || qd[3] % kBlock || pd.size() != 3 || pd[2] != qd[3] / 2 + qd[3] / kBlock ||
      td.size() != 2 || td[0] != qd[0] || w.element_count() != qd[0] * qd[1] * qd[2] ||
      visible.element_count() != qd[0] * qd[1])
    return ffi::Error::InvalidArgument(
        "index_scores: q [B, T, I, Dk], weights [B, T, I], key pages [P, S, Dk/2 + Dk/32], page table [B, n], "
        "n_visible [B, T] expected");
  const Problem p{q.typed_data(), w.typed_data(), pages.typed_data(), table.typed_data(), visible.typed_data(),
                  out->typed_data(), qd[0], qd[1], qd[2], qd[3], pd[0], pd[1], td[1] * pd[1]};
  static const bool avx512 = ced::has_avx512();
  const bool vector = avx512 && !portable;  // the tests compare both
  const int64_t chunks = (td[1] + kPagesPerItem - 1) / kPagesPerItem;
  ced::share_items(pool, p.b * chunks, [p, vector, chunks, n = td[1]](int64_t item) {
    const int64_t row = item / chunks, c = item % chunks, first = c * kPagesPerItem;
    const int64_t last = std::min(n, (c + 1) * kPagesPerItem);
    if (!vector) return score_pages_generic(p, row, first, last);
    int32_t limit = 0;  // no query of the row sees a slot at or past it: those are -inf, unread
    for (int64_t t = 0; t < p.t; ++t) limit = std::max(limit, p.visible[row * p.t + t]);
    const int64_t begin = first * p.slots, end = last * p.slots, seen_end = std::clamp<int64_t>(limit, begin, end);
    thread_local std::vector<float> keys;
    keys.resize(p.dk * 16);
    for (int64_t c0 = begin; c0 < seen_end; c0 += 16) score16(p, row, c0, std::min(end, c0 + 16), keys.data());
    const int64_t unseen = std::max(seen_end, std::min(end, begin + (seen_end - begin + 15) / 16 * 16));
    for (int64_t t = 0; t < p.t; ++t)
      std::fill(p.out + (row * p.t + t) * p.width + unseen, p.out + (row * p.t + t) * p.width + end,
                -std::numeric_limits<float>::infinity());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CedIndexScores, IndexScores,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("portable"));
