// Paged attention of a quantized CPU core in one call: each row's new key and value go into their cache slots,
// then its query heads attend over the row's pages where they lie, instead of aten gathering every page of the
// batch into a padded copy (aten::index, twice a layer) for SDPA with a mask.
// docs/design.md, Models and kernels; engine/kernels/cpu/extension.py builds this file, and
// engine/model/backends/cpu_ops.py calls it for every row of a quantized CPU core's steps: a prompt's rows as rows
// whose contexts end at their own positions (seq_table: the rows share their request's page table), so a token's
// bits are the same whether it came in a prompt, a verify round or a decode step (an activation rounded to
// integers before each product turns the last-place differences of two kernels into different tokens).
//
// Per row b and KV head g (the unit of work, spread over threads): the H / KVH query heads of the group
// read each key once; scores s_j = scale * q . k_j in fp32 for the row's keys j < context_lens[b] (the last
// `window` of them for a sliding-window layer), then a softmax, e_j = exp(s_j - max s) and out = sum_j e_j v_j /
// sum_j e_j. Every row is computed alone, so its result does not depend on the other rows of the step (SDPA's
// padded batch did: docs/cpu.md, "Batch invariance").

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

// Query heads, and vectors of 8 values of a head, that share one pass over the keys' values: their 12 accumulators,
// the heads' 3 weights and a value vector fill AVX2's 16 registers, and 12 independent multiply-add chains hide
// their latency (one head's 8 vectors at a time, a pass over the keys per vector, was latency-bound: 3.5x slower).
constexpr int64_t HEADS_AT_ONCE = 3;
constexpr int64_t VECTORS_AT_ONCE = 4;

float dot(const float* a, const float* b, int64_t D) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
  }
  for (; d + 8 <= D; d += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
  float sum = flare_cpu::hsum(_mm256_add_ps(acc0, acc1));
  for (; d < D; ++d) sum += a[d] * b[d];
  return sum;
}

// The sums of each of 4 vectors, as the 4 lanes of one.
inline __m128 sums_of_4(const __m256 a[4]) {
  const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}

// scores[h * n + j] = scale * q_h . keys[j] for HEADS query heads (q_h at q + h * q_head) and n keys of D values:
// 4 keys at a time for all the heads, so each key is read once for them (12 accumulators, 3 queries and a key fill
// the 16 registers), one accumulator per head and key, summed across lanes together (a sum across one vector's
// lanes per key took as long as its multiply-adds). Keys past the last 8 go one by one.
template <int HEADS>
void key_scores(const float* q, int64_t q_head, const float* const* keys, int64_t n, int64_t D, float scale,
                float* scores) {
  int64_t j = 0;
  if (D % 8 == 0) {
    for (const int64_t whole = n / 8 * 8; j < whole; j += 4) {
      __m256 acc[HEADS][4];
      for (int h = 0; h < HEADS; ++h)
        for (int t = 0; t < 4; ++t) acc[h][t] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        __m256 query[HEADS];
        for (int h = 0; h < HEADS; ++h) query[h] = _mm256_loadu_ps(q + h * q_head + d);
        for (int t = 0; t < 4; ++t) {
          const __m256 key = _mm256_loadu_ps(keys[j + t] + d);
          for (int h = 0; h < HEADS; ++h) acc[h][t] = _mm256_fmadd_ps(query[h], key, acc[h][t]);
        }
      }
      for (int h = 0; h < HEADS; ++h)
        _mm_storeu_ps(scores + h * n + j, _mm_mul_ps(sums_of_4(acc[h]), _mm_set1_ps(scale)));
    }
  }
  for (; j < n; ++j)
    for (int h = 0; h < HEADS; ++h) scores[h * n + j] = scale * dot(q + h * q_head, keys[j], D);
}

using KeyScores = void (*)(const float*, int64_t, const float* const*, int64_t, int64_t, float, float*);
constexpr KeyScores KEY_SCORES[HEADS_AT_ONCE] = {key_scores<1>, key_scores<2>, key_scores<3>};

// e_j = exp(s_j - max s) in place over n scores; returns sum e_j.
float softmax_numerators(float* s, int64_t n) {
  __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + j));
  float largest = flare_cpu::hmax(top);
  for (; j < n; ++j) largest = std::max(largest, s[j]);
  const __m256 shift = _mm256_set1_ps(largest);
  __m256 total = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = flare_cpu::exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
    _mm256_storeu_ps(s + j, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = flare_cpu::hsum(total);
  for (; j < n; ++j) {
    s[j] = flare_cpu::exp1(s[j] - largest);
    sum += s[j];
  }
  return sum;
}

// o[h, d + 8t ...] = inverse[h] * sum_j e[h, j] values[j][d + 8t ...] for HEADS heads (e: their softmax numerators,
// n a head) and VECTORS vectors of 8 from d; o's heads D apart. Each lane sums its keys in order, one multiply-add
// at a time.
template <int HEADS, int VECTORS>
void weighted_values(const float* e, int64_t n, const float* const* values, int64_t d, const float* inverse, float* o,
                     int64_t D) {
  __m256 acc[HEADS][VECTORS];
  for (int h = 0; h < HEADS; ++h)
    for (int t = 0; t < VECTORS; ++t) acc[h][t] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* value = values[j] + d;
    __m256 weight[HEADS];
    for (int h = 0; h < HEADS; ++h) weight[h] = _mm256_set1_ps(e[h * n + j]);
    for (int t = 0; t < VECTORS; ++t) {
      const __m256 v = _mm256_loadu_ps(value + 8 * t);
      for (int h = 0; h < HEADS; ++h) acc[h][t] = _mm256_fmadd_ps(weight[h], v, acc[h][t]);
    }
  }
  for (int h = 0; h < HEADS; ++h)
    for (int t = 0; t < VECTORS; ++t)
      _mm256_storeu_ps(o + h * D + d + 8 * t, _mm256_mul_ps(acc[h][t], _mm256_set1_ps(inverse[h])));
}

// weighted_values by [heads - 1][vectors - 1].
using WeightedValues = void (*)(const float*, int64_t, const float* const*, int64_t, const float*, float*, int64_t);
constexpr WeightedValues WEIGHTED_VALUES[HEADS_AT_ONCE][VECTORS_AT_ONCE] = {
    {weighted_values<1, 1>, weighted_values<1, 2>, weighted_values<1, 3>, weighted_values<1, 4>},
    {weighted_values<2, 1>, weighted_values<2, 2>, weighted_values<2, 3>, weighted_values<2, 4>},
    {weighted_values<3, 1>, weighted_values<3, 2>, weighted_values<3, 3>, weighted_values<3, 4>}};

struct Step {
  const float *q, *k_new, *v_new;
  float *k_cache, *v_cache;
  const int64_t *slot_mapping, *rows, *page_tables, *seq_table, *context_lens;  // seq_table: nullptr, row b's own
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;  // strides of q, k_new and v_new
  int64_t heads, kv_heads, D, pages, page_size, window;
  float scale;
};

// Scratch of one thread: the scores of a group's heads, and where each key and value of the row lie.
struct Scratch {
  std::vector<float> scores, inverse;
  std::vector<const float*> keys, values;
};

// The page table of row b.
const int64_t* table_of(const Step& s, int64_t b) {
  return s.page_tables + (s.seq_table != nullptr ? s.seq_table[b] : b) * s.pages;
}

// Every row's new key and value into its slot, before any row attends: a prompt's rows read each other's.
void store(const Step& s, int64_t B) {
  const int64_t D = s.D, token = s.kv_heads * D;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t row = s.rows[b], slot = s.slot_mapping[row];
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      std::memcpy(s.k_cache + slot * token + g * D, s.k_new + row * s.k_row + g * s.k_head, D * sizeof(float));
      std::memcpy(s.v_cache + slot * token + g * D, s.v_new + row * s.v_row + g * s.v_head, D * sizeof(float));
    }
  }
}

// Row b, KV head g: its query heads over the row's keys.
void attend(const Step& s, int64_t b, int64_t g, Scratch& scratch, float* out) {
  const int64_t D = s.D, group = s.heads / s.kv_heads, token = s.kv_heads * D, row = s.rows[b];
  const int64_t length = s.context_lens[b];
  const int64_t first = s.window > 0 ? std::max<int64_t>(0, length - s.window) : 0, n = length - first;
  const int64_t* table = table_of(s, b);
  // Page by page (no division per key: a 64-bit one costs 40-odd cycles on Zen 1).
  scratch.keys.resize(n);
  scratch.values.resize(n);
  for (int64_t j = first; j < length;) {
    const int64_t page = j / s.page_size, end = std::min(length, (page + 1) * s.page_size);
    const int64_t base = (table[page] * s.page_size - page * s.page_size) * token + g * D;
    for (; j < end; ++j) {
      scratch.keys[j - first] = s.k_cache + base + j * token;
      scratch.values[j - first] = s.v_cache + base + j * token;
    }
  }
  std::vector<float>& scores = scratch.scores;
  scores.resize(group * n);
  const float* q = s.q + row * s.q_row + g * group * s.q_head;
  for (int64_t h = 0; h < group; h += HEADS_AT_ONCE)
    KEY_SCORES[std::min(HEADS_AT_ONCE, group - h) - 1](q + h * s.q_head, s.q_head, scratch.keys.data(), n, D, s.scale,
                                                       &scores[h * n]);
  std::vector<float>& inverse = scratch.inverse;
  inverse.resize(group);
  for (int64_t h = 0; h < group; ++h) inverse[h] = 1.f / softmax_numerators(&scores[h * n], n);
  float* o = out + g * group * D;
  for (int64_t h = 0; h < group; h += HEADS_AT_ONCE) {
    const int64_t count = std::min(HEADS_AT_ONCE, group - h);
    int64_t d = 0;
    while (d + 8 <= D) {
      const int64_t vectors = std::min<int64_t>(VECTORS_AT_ONCE, (D - d) / 8);
      WEIGHTED_VALUES[count - 1][vectors - 1](&scores[h * n], n, scratch.values.data(), d, &inverse[h], o + h * D, D);
      d += 8 * vectors;
    }
    for (; d < D; ++d) {  // a head size that is not a multiple of 8
      for (int64_t i = h; i < h + count; ++i) {
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) sum += scores[i * n + j] * scratch.values[j][d];
        o[i * D + d] = sum * inverse[i];
      }
    }
  }
}

void check_int64(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == dim && t.is_contiguous(), "decode_attention: ", what,
              " must be contiguous int64 of ", dim, " dimension(s)");
}

// Bad metadata is an error here rather than a write or read outside the cache.
void check_rows(const Step& s, int64_t B, int64_t T, int64_t slots, int64_t tables) {
  const int64_t cache_pages = slots / s.page_size;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t row = s.rows[b], length = s.context_lens[b];
    TORCH_CHECK(row >= 0 && row < T, "decode_attention: row ", row, " outside the step's ", T);
    TORCH_CHECK(s.slot_mapping[row] >= 0 && s.slot_mapping[row] < slots, "decode_attention: slot ",
                s.slot_mapping[row], " outside the cache's ", slots);
    TORCH_CHECK(length >= 1 && length <= s.pages * s.page_size, "decode_attention: context length ", length,
                " of a row with ", s.pages, " pages of ", s.page_size);
    if (s.seq_table != nullptr)
      TORCH_CHECK(s.seq_table[b] >= 0 && s.seq_table[b] < tables, "decode_attention: page table ", s.seq_table[b],
                  " outside the step's ", tables);
    for (int64_t p = 0; p * s.page_size < length; ++p) {
      const int64_t page = table_of(s, b)[p];
      TORCH_CHECK(page >= 0 && page < cache_pages, "decode_attention: page ", page, " outside the cache's ",
                  cache_pages);
    }
  }
}

}  // namespace

namespace flare_cpu {

// q [T, H, D], k and v [T, KVH, D] (the step's rows; unit last stride), caches [slots, KVH, D] (written: each
// attending row's k and v go to slot_mapping[row]), rows / context_lens of the B attending rows, their page tables:
// page_tables [B, P], or page_tables [S, P] and seq_table [B] (row b's is page_tables[seq_table[b]])
// -> out [B, H, D]. window <= 0: every key of the context.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& rows,
                            const at::Tensor& page_tables, const at::Tensor& context_lens, int64_t page_size,
                            double scale, int64_t window, const c10::optional<at::Tensor>& seq_table) {
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kFloat && t->stride(2) == 1,
                "decode_attention: q, k and v must be fp32 [T, heads, D] with a unit last stride");
  const int64_t T = q.size(0), H = q.size(1), KVH = k.size(1), D = q.size(2), B = rows.numel();
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == T && k.size(2) == D && KVH > 0 && H % KVH == 0,
              "decode_attention: k and v [T, KVH, D] with KVH dividing the query heads");
  for (const at::Tensor* t : {&k_cache, &v_cache})
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(1) == KVH &&
                    t->size(2) == D && t->size(0) == k_cache.size(0),
                "decode_attention: caches must be contiguous fp32 [slots, KVH, D]");
  check_int64(slot_mapping, 1, "slot_mapping");
  check_int64(rows, 1, "rows");
  check_int64(page_tables, 2, "page_tables");
  check_int64(context_lens, 1, "context_lens");
  if (seq_table.has_value()) check_int64(*seq_table, 1, "seq_table");
  TORCH_CHECK(slot_mapping.numel() == T && context_lens.numel() == B && page_size > 0 &&
                  (seq_table.has_value() ? seq_table->numel() == B : page_tables.size(0) == B),
              "decode_attention: one slot per step row, one page table (or seq_table entry) and context length per "
              "attending row");
  const Step s{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), k_cache.data_ptr<float>(),
               v_cache.data_ptr<float>(), slot_mapping.data_ptr<int64_t>(), rows.data_ptr<int64_t>(),
               page_tables.data_ptr<int64_t>(), seq_table.has_value() ? seq_table->data_ptr<int64_t>() : nullptr,
               context_lens.data_ptr<int64_t>(), q.stride(0), q.stride(1),
               k.stride(0), k.stride(1), v.stride(0), v.stride(1), H, KVH, D, page_tables.size(1), page_size, window,
               static_cast<float>(scale)};
  check_rows(s, B, T, k_cache.size(0), page_tables.size(0));
  store(s, B);
  at::Tensor out = at::empty({B, H, D}, q.options());
  float* o = out.data_ptr<float>();
  const int64_t longest = B ? *std::max_element(s.context_lens, s.context_lens + B) : 0;
  const int64_t work = std::max<int64_t>(1, 2 * longest * (H / KVH) * D);
  const int64_t grain = std::max<int64_t>(1, flare_cpu::MIN_MULTIPLY_ADDS_PER_THREAD / work);
  at::parallel_for(0, B * KVH, grain, [&](int64_t i0, int64_t i1) {
    Scratch scratch;
    for (int64_t i = i0; i < i1; ++i) attend(s, i / KVH, i % KVH, scratch, o + (i / KVH) * H * D);
  });
  return out;
}

}  // namespace flare_cpu

TORCH_LIBRARY_FRAGMENT(flare_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor rows, Tensor page_tables, Tensor context_lens, int page_size, float scale, int window, "
        "Tensor? seq_table=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(flare_cpu, CPU, m) { m.impl("decode_attention", &flare_cpu::decode_attention); }
