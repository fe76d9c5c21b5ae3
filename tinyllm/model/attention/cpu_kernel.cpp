// Paged attention on the CPU, reading the K/V blocks in place through the block table.
//
// One work item is (row, query tile, KV head): the tile's new tokens times the KV head's query
// heads (grouped-query attention) make a small set of query vectors that share one pass over
// the K/V tokens they can see, so each K/V tile is read from memory once per group. The pass
// is an online softmax over tiles of kTile tokens: the scores of a tile, then their
// exponentials in one loop the compiler vectorizes (fast_exp), then the V accumulation.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kTile = 32;       // K/V tokens per online-softmax step: 8 KiB of fp32 K at D=64
constexpr int64_t kQueryTile = 16;  // new tokens of a prefill row that share one pass over K/V

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// exp(x) for x <= 0 (scores minus their running max), branch-free so that a loop of it
// vectorizes: 2^n * e^r with r in [-ln2/2, ln2/2] and Cephes' polynomial for e^r (about 1 ulp).
// Below -87 the result is clamped to ~1e-38 instead of 0: negligible next to the sum, which
// holds at least one e^0.
inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += q[d] * to_float(k[d]);
  return s;
}

struct Item {
  int64_t row, first, last;  // new tokens [first, last) of the row
};

template <typename T>
void attend_impl(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_rows,
                 double scale) {
  const int64_t Hq = q.size(1), D = q.size(2), bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv, max_blocks = block_tables.size(1);
  const int64_t token_stride = Hkv * D;  // between consecutive tokens of a block
  const T* qp = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();

  std::vector<Item> items;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t n = starts[r + 1] - starts[r];
    for (int64_t i = 0; i < n; i += kQueryTile) items.push_back({r, i, std::min(n, i + kQueryTile)});
  }
  const int64_t num_items = static_cast<int64_t>(items.size()) * Hkv;

  // Items differ in cost (a decode row against a prefill tile), so threads take the next one
  // as they finish instead of a fixed share each.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const int64_t max_q = kQueryTile * G;
    std::vector<float> qf(max_q * D), acc(max_q * D), m(max_q), l(max_q), p(kTile);
    std::vector<int64_t> limit(max_q);
    const T* k_rows[kTile];
    const T* v_rows[kTile];
    for (int64_t w; (w = next.fetch_add(1)) < num_items;) {
      const Item& it = items[w / Hkv];
      const int64_t g = w % Hkv, L = lens[it.row];
      const int64_t n = starts[it.row + 1] - starts[it.row];
      const int64_t nq = (it.last - it.first) * G;
      const int64_t* table = tables + it.row * max_blocks;
      // Query vector j is head g * G + j % G of new token first + j / G, at position
      // L - n + first + j / G: it sees the `limit` keys up to and including that position.
      for (int64_t j = 0; j < nq; ++j) {
        const T* src = qp + ((starts[it.row] + it.first + j / G) * Hq + g * G + j % G) * D;
        for (int64_t d = 0; d < D; ++d) qf[j * D + d] = to_float(src[d]) * static_cast<float>(scale);
        limit[j] = L - n + it.first + j / G + 1;
        m[j] = -std::numeric_limits<float>::infinity();
        l[j] = 0.f;
      }
      std::fill(acc.begin(), acc.begin() + nq * D, 0.f);
      const int64_t keys = limit[nq - 1];
      for (int64_t k0 = 0; k0 < keys; k0 += kTile) {
        const int64_t tl = std::min(kTile, keys - k0);
        for (int64_t t = 0; t < tl; ++t) {
          const int64_t pos = k0 + t;
          const int64_t slot = (table[pos / bs] * bs + pos % bs) * token_stride + g * D;
          k_rows[t] = kc + slot;
          v_rows[t] = vc + slot;
        }
        for (int64_t j = 0; j < nq; ++j) {
          // Keys past a query's position are never read, so nothing there can leak in.
          const int64_t cnt = std::min(tl, limit[j] - k0);
          if (cnt <= 0) continue;
          const float* qj = &qf[j * D];
          float mx = m[j];
          for (int64_t t = 0; t < cnt; ++t) {
            p[t] = dot(qj, k_rows[t], D);
            mx = std::max(mx, p[t]);
          }
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < cnt; ++t) {
            p[t] = fast_exp(p[t] - mx);
            sum += p[t];
          }
          const float alpha = std::exp(m[j] - mx);  // exp(-inf) = 0 on the first tile
          m[j] = mx;
          l[j] = l[j] * alpha + sum;
          float* aj = &acc[j * D];
          for (int64_t d = 0; d < D; ++d) aj[d] *= alpha;
          for (int64_t t = 0; t < cnt; ++t) {
            const T* vt = v_rows[t];
            const float pt = p[t];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) aj[d] += pt * to_float(vt[d]);
          }
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        T* dst = op + ((starts[it.row] + it.first + j / G) * Hq + g * G + j % G) * D;
        const float inv = 1.f / l[j];
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[j * D + d] * inv);
      }
    }
  });
}

// Attention for rows [0, num_rows) of the step into `out` (N, Hq, D); the caches hold every
// row's context, new tokens included.
void attend(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
            const at::Tensor& query_start_loc, int64_t num_rows, double scale) {
  for (const at::Tensor* t : {&out, &q, &k_cache, &v_cache, &block_tables, &seq_lens,
                              &query_start_loc}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "tensors must be contiguous, on CPU");
  }
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type()
                  && q.scalar_type() == out.scalar_type(),
              "q, the caches and out must share one dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc}) {
    TORCH_CHECK(t->scalar_type() == at::kLong, "block tables, lengths and starts must be int64");
  }
  if (q.scalar_type() == at::kFloat) {
    attend_impl<float>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                       num_rows, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    attend_impl<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens,
                               query_start_loc, num_rows, scale);
  } else {
    TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "paged attention over the block table, in place");
}
