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

#include "shared_work.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kBlock = 32;
constexpr int64_t kPagesPerItem = 16;
constexpr float kE2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                             0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline float ue8m0(uint8_t s) {  // pallas_kernels.formats.ue8m0_to_f32: 0 reads as 0, 255 is NaN
  uint32_t bits = static_cast<uint32_t>(s) << 23 | (s == 255 ? 1u << 22 : 0u);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

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
__attribute__((target_clones("avx2", "default")))
float dot_generic(const float* q, const float* key, int64_t dk) {
  float total = 0.0f;
  for (int64_t blk = 0; blk < dk / kBlock; ++blk) {
    float s = 0.0f;  // exact in any order
    for (int j = 0; j < kBlock; ++j) s += q[blk * kBlock + j] * key[blk * kBlock + j];
    total = blk == 0 ? s : total + s;
  }
  return total;
}

#define CED_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

CED_AVX512 float dot_avx512(const float* q, const float* key, int64_t dk) {
  float total = 0.0f;
  for (int64_t blk = 0; blk < dk / kBlock; ++blk) {
    const float* qb = q + blk * kBlock;
    const float* kb = key + blk * kBlock;
    __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qb), _mm512_loadu_ps(kb));
    s = _mm512_fmadd_ps(_mm512_loadu_ps(qb + 16), _mm512_loadu_ps(kb + 16), s);
    const float v = _mm512_reduce_add_ps(s);  // exact in any order
    total = blk == 0 ? v : total + v;
  }
  return total;
}

using Dot = float (*)(const float*, const float*, int64_t);

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

void score_pages(const Problem& p, Dot dot, int64_t row, int64_t first, int64_t last) {
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
        const float scale = ue8m0(e[p.dk / 2 + (2 * i) / kBlock]);
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
          const float d = round_bf16(dot(q + h * p.dk, key.data(), p.dk));
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
  static const bool avx512 = has_avx512();
  const Dot dot = (avx512 && !portable) ? dot_avx512 : dot_generic;  // the tests compare both
  const int64_t chunks = (td[1] + kPagesPerItem - 1) / kPagesPerItem;
  ced::share_items(pool, p.b * chunks, [p, dot, chunks, n = td[1]](int64_t item) {
    const int64_t row = item / chunks, c = item % chunks;
    score_pages(p, dot, row, c * kPagesPerItem, std::min(n, (c + 1) * kPagesPerItem));
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
