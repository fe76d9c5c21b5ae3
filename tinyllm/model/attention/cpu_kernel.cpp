// Paged attention on the CPU, reading the K/V blocks in place through the block table.
//
// One routine for every query, a decode's or a prompt's: an item is (row, new token, KV head),
// the group's query heads of that token together, so each K/V tile is read once per group. It
// walks the keys the token may see (up to its own position) from key 0 in tiles of kTile tokens,
// each token's K and V rows found through the block table, with an online softmax: a running max
// and sum per head, the output so far rescaled whenever the max grows. A score is a dot product
// along the head dim, a tile's exponentials one vectorized loop (fast_exp). Keys past a query's
// position are never read, so whatever the scratch block and the unused slots hold cannot leak
// in. Threads take items as they finish (their costs differ).
//
// Why one routine: a query's arithmetic then depends on nothing but its own position and keys,
// not on how many tokens its row has or what shares the step. So a token's K/V and logits are
// the same bits whether it ran in a decode, a prompt chunk of any size, a recompute after
// preemption, or was read back from the prefix cache. A second routine for prompt rows (their
// queries in vector lanes, scores as outer products) summed in another order and broke that;
// measured against this one on a 2000-token prompt and on offline-small, it was no faster.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "../cpu_ops.h"
#include "../fast_exp.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using tinyllm::check_array;
using tinyllm::fast_exp;

constexpr int64_t kTile = 32;   // keys per online-softmax step: 8 KiB of fp32 K at D=64
constexpr float kInf = std::numeric_limits<float>::infinity();

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// What every item reads. kD: the head dim when it is known at compile time (loops the compiler
// unrolls), else 0 and loops run to the runtime D.
template <int64_t kD, typename T>
struct Step {
  int64_t Hq, D, bs, Hkv, G, max_blocks, q_row;  // q_row: q's stride between tokens
  const T *q, *k_cache, *v_cache;
  T* out;
  const int64_t *tables, *lens, *starts;
  float scale;

  int64_t head_dim() const { return kD ? kD : D; }

  // Pointers to the K and V rows of KV head g for a row's tokens [k0, k0 + n).
  void rows(int64_t row, int64_t g, int64_t k0, int64_t n, const T** k, const T** v) const {
    const int64_t* table = tables + row * max_blocks;
    for (int64_t t = 0, b = k0 / bs, off = k0 % bs; t < n; ++t) {
      const int64_t at = ((table[b] * bs + off) * Hkv + g) * head_dim();
      k[t] = k_cache + at;
      v[t] = v_cache + at;
      if (++off == bs) off = 0, ++b;
    }
  }

  // Into L1, every cache line of n K and V rows.
  void prefetch(const T* const* k, const T* const* v, int64_t n) const {
    const int64_t bytes = head_dim() * static_cast<int64_t>(sizeof(T));
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k[t]) + b);
        __builtin_prefetch(reinterpret_cast<const char*>(v[t]) + b);
      }
    }
  }
};

// One thread's buffers, reused across its items.
struct Scratch {
  std::vector<float> q, out, m, l;  // the group's queries (G, D), outputs, max and sum
};

template <int64_t kD, typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < (kD ? kD : D); ++d) s += q[d] * to_float(k[d]);
  return s;
}

// New token `tok` of a row (its position: the row's context minus its new tokens, plus tok),
// KV head g's query heads.
template <int64_t kD, typename T>
void attend_query(const Step<kD, T>& c, int64_t row, int64_t tok, int64_t g, Scratch& w) {
  const int64_t n = c.starts[row + 1] - c.starts[row];
  const int64_t D = c.head_dim(), G = c.G, L = c.lens[row] - n + tok + 1;  // keys it sees
  float *qf = w.q.data(), *acc = w.out.data(), *m = w.m.data(), *l = w.l.data();
  const T* q = c.q + (c.starts[row] + tok) * c.q_row + g * G * D;  // the group's heads adjacent
  for (int64_t x = 0; x < G * D; ++x) qf[x] = to_float(q[x]) * c.scale;
  std::fill(acc, acc + G * D, 0.f);
  std::fill(m, m + G, -kInf);
  std::fill(l, l + G, 0.f);
  const T* k_tiles[2][kTile];  // this tile's rows and the next one's
  const T* v_tiles[2][kTile];
  float p[kTile];
  c.rows(row, g, 0, std::min(kTile, L), k_tiles[0], v_tiles[0]);
  for (int64_t k0 = 0, i = 0; k0 < L; k0 += kTile, i ^= 1) {
    const int64_t cnt = std::min(kTile, L - k0), next = std::min(kTile, L - k0 - kTile);
    const T* const* k_rows = k_tiles[i];
    const T* const* v_rows = v_tiles[i];
    if (next > 0) {  // ask for the next tile now, so its loads overlap this tile's arithmetic
      c.rows(row, g, k0 + kTile, next, k_tiles[i ^ 1], v_tiles[i ^ 1]);
      c.prefetch(k_tiles[i ^ 1], v_tiles[i ^ 1], next);
    }
    for (int64_t h = 0; h < G; ++h) {
      float mx = m[h];
      for (int64_t t = 0; t < cnt; ++t) {
        p[t] = dot<kD>(qf + h * D, k_rows[t], D);
        mx = std::max(mx, p[t]);
      }
      // The whole tile (a fixed trip count vectorizes cleanly), its tail past cnt weighing 0.
      float sum = 0.f;
      for (int64_t t = 0; t < kTile; ++t) {
        p[t] = t < cnt ? fast_exp(p[t] - mx) : 0.f;
        sum += p[t];
      }
      const float alpha = fast_exp(m[h] - mx);  // ~0 on the first tile, where m is -inf
      m[h] = mx;
      l[h] = l[h] * alpha + sum;
      float* __restrict a = acc + h * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
      // Four tokens per pass: the compiler keeps `a` in memory, not registers, so this loads
      // and stores it once per four rows of V instead of once per row.
      int64_t t = 0;
      for (; t + 4 <= cnt; t += 4) {
        const T *v0 = v_rows[t], *v1 = v_rows[t + 1], *v2 = v_rows[t + 2], *v3 = v_rows[t + 3];
        const float p0 = p[t], p1 = p[t + 1], p2 = p[t + 2], p3 = p[t + 3];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          a[d] += p0 * to_float(v0[d]) + p1 * to_float(v1[d]) + p2 * to_float(v2[d]) +
                  p3 * to_float(v3[d]);
        }
      }
      for (; t < cnt; ++t) {
        const T* v = v_rows[t];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p[t] * to_float(v[d]);
      }
    }
  }
  T* out = c.out + ((c.starts[row] + tok) * c.Hq + g * G) * D;
  for (int64_t h = 0; h < G; ++h) {
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<T>(acc[h * D + d] / l[h]);
  }
}

struct Item {
  int64_t row, tok, g;
};

template <int64_t kD, typename T>
void attend_impl(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_rows,
                 double scale) {
  const int64_t Hkv = k_cache.size(2), G = q.size(1) / Hkv, D = q.size(2);
  const Step<kD, T> c{q.size(1), D, k_cache.size(1), Hkv, G, block_tables.size(1), q.stride(0),
                      q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                      out.data_ptr<T>(), block_tables.data_ptr<int64_t>(),
                      seq_lens.data_ptr<int64_t>(), query_start_loc.data_ptr<int64_t>(),
                      static_cast<float>(scale)};
  std::vector<Item> items;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t n = c.starts[r + 1] - c.starts[r];
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t g = 0; g < Hkv; ++g) items.push_back({r, t, g});
    }
  }
  // One task per thread of torch's pool, each taking the next item until none is left.
  std::atomic<size_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch w{std::vector<float>(G * D), std::vector<float>(G * D), std::vector<float>(G),
              std::vector<float>(G)};
    for (size_t i; (i = next.fetch_add(1)) < items.size();) {
      const Item& it = items[i];
      attend_query(c, it.row, it.tok, it.g, w);
    }
  });
}

template <typename T>
void attend_typed(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_rows,
                  double scale) {
  auto run = [&](auto kD) {
    attend_impl<decltype(kD)::value, T>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                        query_start_loc, num_rows, scale);
  };
  switch (q.size(2)) {  // the common head dims get unrolled loops
    case 64: return run(std::integral_constant<int64_t, 64>{});
    case 128: return run(std::integral_constant<int64_t, 128>{});
    default: return run(std::integral_constant<int64_t, 0>{});
  }
}

// The step's tensors against each other, then each row's numbers against the caches, before
// anything is read through them: a length or table entry out of range would read outside the
// pool, a block size or KV head count of zero would divide by zero. Once per call, O(rows +
// their blocks).
void check_step(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const at::Tensor& block_tables,
                const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_rows) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "paged_attention: q must be float32 or bfloat16, not ", dtype);
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: q must be on the CPU, not ", q.device());
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_attention: q ",
              q.sizes(), " of strides ", q.strides(), " must be (tokens, heads, head_dim) with "
              "each token's heads contiguous");
  check_array("paged_attention", "out", out, dtype);
  check_array("paged_attention", "k_cache", k_cache, dtype);
  check_array("paged_attention", "v_cache", v_cache, dtype);
  TORCH_CHECK(out.sizes() == q.sizes(), "paged_attention: out ", out.sizes(), " must be q's ",
              q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(1) > 0 && k_cache.size(2) > 0 &&
                  k_cache.size(3) == q.size(2),
              "paged_attention: k_cache ", k_cache.sizes(), " must be (blocks, block_size >= 1, "
              "kv_heads >= 1, q's head_dim ", q.size(2), ")");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "paged_attention: v_cache ", v_cache.sizes(),
              " must be k_cache's ", k_cache.sizes());
  const int64_t Hkv = k_cache.size(2);
  TORCH_CHECK(q.size(1) > 0 && q.size(1) % Hkv == 0, "paged_attention: q's ", q.size(1),
              " heads must be a positive multiple of the caches' ", Hkv, " KV heads");
  check_array("paged_attention", "block_tables", block_tables, at::kLong);
  check_array("paged_attention", "seq_lens", seq_lens, at::kLong);
  check_array("paged_attention", "query_start_loc", query_start_loc, at::kLong);
  TORCH_CHECK(num_rows >= 0, "paged_attention: num_rows must be >= 0, not ", num_rows);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_rows,
              "paged_attention: block_tables ", block_tables.sizes(), " must be [num_rows ",
              num_rows, ", blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == num_rows, "paged_attention: seq_lens ",
              seq_lens.sizes(), " must be [num_rows ", num_rows, "]");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == num_rows + 1,
              "paged_attention: query_start_loc ", query_start_loc.sizes(),
              " must be [num_rows + 1 ", num_rows + 1, "]");
  const int64_t *starts = query_start_loc.data_ptr<int64_t>(), *lens = seq_lens.data_ptr<int64_t>();
  const int64_t *tables = block_tables.data_ptr<int64_t>(), max_blocks = block_tables.size(1);
  const int64_t bs = k_cache.size(1), pool = k_cache.size(0);
  TORCH_CHECK(starts[0] == 0 && starts[num_rows] == q.size(0), "paged_attention: query_start_loc "
              "must run from 0 to q's ", q.size(0), " tokens, not from ", starts[0], " to ",
              starts[num_rows]);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t n = starts[r + 1] - starts[r], blocks = (lens[r] + bs - 1) / bs;
    TORCH_CHECK(n >= 0 && lens[r] >= n, "paged_attention: row ", r, " has ", n,
                " new tokens and seq_lens ", lens[r], "; its context must hold its new tokens");
    TORCH_CHECK(blocks <= max_blocks, "paged_attention: row ", r, "'s ", lens[r], " tokens need ",
                blocks, " blocks of ", bs, ", block_tables has ", max_blocks);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t id = tables[r * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < pool, "paged_attention: block_tables[", r, "][", b, "] = ", id,
                  " outside the caches' ", pool, " blocks");
    }
  }
}

// Each new token's K and V rows (N, Hkv, D), rows possibly strided (views of the fused qkv),
// copied to its cache slot. N: q's tokens.
void write_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& slot_mapping, int64_t n) {
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == k_cache.scalar_type(),
                "paged_attention: k and v must be on the CPU, of the caches' dtype ",
                k_cache.scalar_type());
    TORCH_CHECK(t->dim() == 3 && t->size(0) == n && t->size(1) == k_cache.size(2) &&
                    t->size(2) == k_cache.size(3) && t->stride(2) == 1 &&
                    t->stride(1) == t->size(2),
                "paged_attention: k ", k.sizes(), " and v ", v.sizes(), " must be [", n, ", ",
                k_cache.size(2), ", ", k_cache.size(3),
                "] (q's tokens, the caches' heads and head_dim), each token's heads contiguous");
  }
  check_array("paged_attention", "slot_mapping", slot_mapping, at::kLong);
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == n,
              "paged_attention: slot_mapping ", slot_mapping.sizes(), " must be [", n,
              "], one slot per token");
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "paged_attention: slot ", slot[t],
                " outside the cache's ", slots);
  }
  const int64_t bytes = k.size(1) * k.size(2) * k.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto *ks = static_cast<const char*>(k.data_ptr()), *vs = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(kc + slot[t] * bytes, ks + t * k.stride(0) * k.element_size(), bytes);
    std::memcpy(vc + slot[t] * bytes, vs + t * v.stride(0) * v.element_size(), bytes);
  }
}

}  // namespace

namespace tinyllm {

// Attention for rows [0, num_rows) of the step, written into out (N, Hq, D). With k, v and
// slot_mapping, the step's new K/V rows are written into the caches first; without, the caches
// already hold every row's context, this step's new tokens included. q's rows may be strided.
void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const std::optional<at::Tensor>& k,
                     const std::optional<at::Tensor>& v,
                     const std::optional<at::Tensor>& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, int64_t num_rows, double scale) {
  check_step(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_rows);
  TORCH_CHECK(k.has_value() == v.has_value() && k.has_value() == slot_mapping.has_value(),
              "paged_attention: k, v and slot_mapping come together");
  if (k) write_cache(k_cache, v_cache, *k, *v, *slot_mapping, q.size(0));
  if (q.scalar_type() == at::kFloat) {
    attend_typed<float>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                        num_rows, scale);
  } else {
    attend_typed<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                query_start_loc, num_rows, scale);
  }
}

}  // namespace tinyllm

// A torch op rather than a pybind11 module: torch/library.h compiles in a fraction of the
// time torch/extension.h takes.
TORCH_LIBRARY(tinyllm, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor(b!) k_cache, Tensor(c!) v_cache, "
      "Tensor? k, Tensor? v, Tensor? slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, int num_rows, float scale) -> ()",
      &tinyllm::paged_attention);
}
