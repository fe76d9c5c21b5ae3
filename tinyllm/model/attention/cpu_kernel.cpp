// Paged attention on the CPU, reading the K/V blocks in place through the block table.
//
// One routine for every query, a decode's or a prompt's: an item is (row, up to kQueries
// consecutive new tokens, KV head), those tokens' group of query heads together. It walks the
// keys its tokens may see in tiles of kTile tokens, each token's K and V rows found through the
// block table: from key 0, or under a sliding window from the tile that holds its first token's
// first key (whole tiles before it skipped), to its last token. A tile is read once for all the
// item's queries: bf16 rows (or rows not a whole number of vectors long) converted into the
// thread's fp32 scratch, fp32 rows in place. Each query head then takes the tile (attend_tile),
// its keys from its window's first (its position minus the window plus one; key 0 without a
// window) up to its own position, with an online softmax: a running max and sum, the output so
// far rescaled whenever the max grows. Scores kW keys at a time: each key's products along the
// head dim summed as a vector, then the kW vectors reduced to kW scores together by a fixed tree
// of shuffles and adds, not one horizontal sum per key. The output sums V rows in registers. A
// tile's lanes before a query's window and past its position are masked, and no key past the
// item's last token is read, so whatever the scratch block and the unused slots hold cannot
// leak in. Threads take items as they finish (their costs differ). Sharing a tile among an
// item's queries reads and converts it once for all of them, not once per token
// (docs/MEASUREMENTS.md, "Attention over a long context").
//
// Why one routine: a query's arithmetic then depends on nothing but its own position and keys,
// not on how many tokens its row has or what shares the step. Tiles start at multiples of kTile
// and a query's first key follows from its own position, so a window keeps that: the tiles a
// query takes, and which of their keys it sees, are the same whatever shares its item. So a
// token's K/V and logits are the same bits whether it ran in a decode, a prompt chunk of any
// size, a recompute after preemption, or was read back from the prefix cache. Sharing a tile
// among an item's queries is a loop interchange: each query does the operations, in the order,
// it would do alone (tests/test_attention_cpu.py checks a token alone against chunks of 3 to 37,
// with and without a window). A second routine for prompt rows (their queries in vector lanes,
// scores as outer products) would sum in another order and break that.
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
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <xmmintrin.h>
#endif

namespace {

using tinyllm::check_array;
using tinyllm::fast_exp;

constexpr int64_t kTile = 32;    // keys per online-softmax step
constexpr int64_t kQueries = 16;  // a row's consecutive new tokens per item, sharing each tile
constexpr float kInf = std::numeric_limits<float>::infinity();

// The build's widest vector of floats (GCC/Clang vector extensions, so one source serves every
// instruction-set level): 16 lanes with AVX-512, 8 with AVX, 4 otherwise.
#if defined(__AVX512F__)
constexpr int kW = 16;
#elif defined(__AVX__)
constexpr int kW = 8;
#else
constexpr int kW = 4;
#endif
using Vec = float __attribute__((vector_size(kW * sizeof(float))));
using IVec = int32_t __attribute__((vector_size(kW * sizeof(float))));
constexpr int kVecs = 4;  // vectors of a head's output accumulated together (its registers)

inline Vec load(const float* x) {
  Vec v;
  std::memcpy(&v, x, sizeof v);
  return v;
}
inline void store(float* x, Vec v) { std::memcpy(x, &v, sizeof v); }

// The lanes of [a, b] (2 kW lanes) in runs of h: the first run of each 2h (off 0), or the
// second (off h).
template <int h, int off, int... I>
inline Vec pick(Vec a, Vec b, std::integer_sequence<int, I...>) {
#if defined(__clang__)
  return __builtin_shufflevector(a, b, (I / h * 2 * h + I % h + off)...);
#else
  return __builtin_shuffle(a, b, IVec{(I / h * 2 * h + I % h + off)...});
#endif
}
constexpr auto kLanes = std::make_integer_sequence<int, kW>{};

// v[0..2h), each summed across its lanes: the sums, in order, in the lanes of one vector. Each
// level adds pairs of vectors' halves: a key's lanes halve and the vectors too, from 2h = kW
// down to one. The tree a key's partial sums go through is fixed and involves no other key's
// lanes, so its score depends on nothing else in the block.
template <int h>
inline Vec sum_lanes(Vec* v) {
  for (int i = 0; i < h; ++i) {
    v[i] = pick<h, 0>(v[2 * i], v[2 * i + 1], kLanes) + pick<h, h>(v[2 * i], v[2 * i + 1], kLanes);
  }
  if constexpr (h == 1) {
    return v[0];
  } else {
    return sum_lanes<h / 2>(v);
  }
}

// The largest of x's lanes (halving the lanes that count, kW to 1).
template <int h>
inline float max_lane(Vec x) {
  const Vec y = pick<h, h>(x, x, kLanes);
  x = y > x ? y : x;
  if constexpr (h == 1) {
    return x[0];
  } else {
    return max_lane<h / 2>(x);
  }
}

// 0, 1, ..., kW - 1.
template <int... I>
constexpr IVec iota(std::integer_sequence<int, I...>) {
  return IVec{I...};
}

// A head's row in the fp32 scratch: D rounded up to kVecs vectors, the rest zeros.
constexpr int64_t padded_dim(int64_t D) {
  constexpr int64_t kStep = kVecs * kW;
  return (D + kStep - 1) / kStep * kStep;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// A cache row's D values in fp32: fp32 or bf16 as they are; int8 codes times their group's
// scale (cpu_ops.h's layout: the fp32 scales after the codes).
template <typename C>
inline void to_floats(const C* x, float* out, int64_t D) {
  for (int64_t d = 0; d < D; ++d) out[d] = to_float(x[d]);
}
inline void to_floats(const int8_t* x, float* out, int64_t D) {
  for (int64_t g = 0, d0 = 0; d0 < D; ++g, d0 += tinyllm::kGroup) {
    float s;
    std::memcpy(&s, x + D + g * tinyllm::kScaleBytes, sizeof s);
    const int64_t end = std::min(D, d0 + tinyllm::kGroup);
    for (int64_t d = d0; d < end; ++d) out[d] = static_cast<float>(x[d]) * s;
  }
}

// A token's head row of D values as int8 codes and their scales: symmetric, each group of kGroup
// values its own scale, the group's largest magnitude over 127, each value divided by it and
// rounded to the nearest code (ties to even). The row alone sets both, so a
// token's stored codes depend on nothing else in its block or step.
// attention/int8_cache.py's quantize is the same arithmetic, bit for bit.
template <typename T>
void quantize_row(const T* x, int8_t* out, int64_t D) {
  for (int64_t g = 0, d0 = 0; d0 < D; ++g, d0 += tinyllm::kGroup) {
    const int64_t end = std::min(D, d0 + tinyllm::kGroup);
    float amax = 0.f;
    for (int64_t d = d0; d < end; ++d) amax = std::max(amax, std::abs(to_float(x[d])));
    const float s = amax / 127.f;
    for (int64_t d = d0; d < end; ++d) {
      const float code = s > 0.f ? std::nearbyint(to_float(x[d]) / s) : 0.f;
      out[d] = static_cast<int8_t>(std::clamp(code, -127.f, 127.f));
    }
    std::memcpy(out + D + g * tinyllm::kScaleBytes, &s, sizeof s);
  }
}

// What every item reads. kD: the head dim when it is known at compile time (loops the compiler
// unrolls), else 0 and loops run to the runtime D. T: q's and out's dtype; C: the caches' (T, or
// int8_t for an int8 cache, whose rows, codes and scales, are row_len = int8_row(D) long).
template <int64_t kD, typename T, typename C>
struct Step {
  int64_t Hq, D, bs, Hkv, G, max_blocks, q_row, row_len;  // q_row: q's stride between tokens
  const T* q;
  const C *k_cache, *v_cache;
  T* out;
  const int64_t *tables, *lens, *starts;
  float scale;
  int64_t window;  // keys a query sees, itself included; no sliding window: the most int64 holds
  float softcap;   // scores become softcap * tanh(score / softcap) (Gemma 2); 0: as they are
  const float* sinks;  // a logit per query head in each softmax's denominator (gpt-oss), or null

  int64_t head_dim() const { return kD ? kD : D; }
  int64_t padded() const { return padded_dim(head_dim()); }

  // Pointers to the K and V rows of KV head g for a row's tokens [k0, k0 + n).
  void rows(int64_t row, int64_t g, int64_t k0, int64_t n, const C** k, const C** v) const {
    const int64_t* table = tables + row * max_blocks;
    for (int64_t t = 0, b = k0 / bs, off = k0 % bs; t < n; ++t) {
      const int64_t at = ((table[b] * bs + off) * Hkv + g) * row_len;
      k[t] = k_cache + at;
      v[t] = v_cache + at;
      if (++off == bs) off = 0, ++b;
    }
  }

  // Into L1, every cache line of n K and V rows.
  void prefetch(const C* const* k, const C* const* v, int64_t n) const {
    const int64_t bytes = row_len * static_cast<int64_t>(sizeof(C));
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k[t]) + b);
        __builtin_prefetch(reinterpret_cast<const char*>(v[t]) + b);
      }
    }
  }
};

// One thread's buffers, reused across its items; rows of `padded()` floats, zero past D.
struct Scratch {
  std::vector<float> q, out;  // the item's queries' heads (kQueries, G, padded), their outputs
  std::vector<float> m, l;    // each query head's running max and sum
  std::vector<float> k, v;    // the tile's K and V rows in fp32 (kTile, padded)
};

// A tile's K or V rows in fp32: packed in the thread's scratch (converted or padded there), or
// in place in the caches through pointers. Packed rows are faster to walk (no pointer loads);
// pointers spare fp32 rows a copy, which at decode, a tile serving one token, costs more.
struct Packed {
  const float* base;
  int64_t stride;
  const float* operator[](int64_t t) const { return base + t * stride; }
};
struct InPlace {
  const float* const* rows;
  const float* operator[](int64_t t) const { return rows[t]; }
};

// One query head's step over a tile: its query `q` and state (output so far `a`, max, sum), the
// tile's keys [from, cnt) (those it may see: `from` > 0 where its window starts in the tile, and
// from < cnt), rows of P floats (P: the head dim padded to a multiple of kVecs vectors, the
// padding zeros; kP: P when known at compile time, else 0). A `softcap` above 0 squashes each
// score into (-softcap, softcap) by tanh before the softmax, key by key.
// Every query runs exactly this, on nothing but its own values, however many queries share the
// tile: the arithmetic that makes a token's bits independent of its item.
template <int64_t kP, typename Rows>
void attend_tile(const float* __restrict q, float* __restrict a, float& m, float& l, Rows k,
                 Rows v, int64_t from, int64_t cnt, int64_t padded, float softcap) {
  const int64_t P = kP ? kP : padded;
  alignas(64) float p[kTile];
  // Scores kW keys at a time: each key's products summed as vectors along the head dim, then
  // the kW keys' vectors reduced together (sum_lanes) instead of one horizontal sum per key.
  // Blocks wholly before the window are skipped; the lanes of the rest before it are masked.
  for (int64_t t0 = from / kW * kW; t0 < cnt; t0 += kW) {
    Vec s[kW];
    for (int t = 0; t < kW; ++t) {
      const float* kt = k[t0 + t];
      s[t] = load(q) * load(kt);
      for (int64_t x = kW; x < P; x += kW) s[t] += load(q + x) * load(kt + x);
    }
    store(p + t0, sum_lanes<kW / 2>(s));
    if (softcap > 0.f) {
      for (int t = 0; t < kW; ++t) p[t0 + t] = softcap * std::tanh(p[t0 + t] / softcap);
    }
  }
  // The whole tile in these loops (a fixed trip count vectorizes cleanly, where a loop to cnt
  // would be a chain of scalar maxima), the lanes outside [from, cnt) masked: they hold other
  // keys' scores, stale ones or none yet.
  Vec top = Vec{} + m;
  const IVec lane = iota(kLanes);
  const auto lo = static_cast<int32_t>(from), hi = static_cast<int32_t>(cnt);
  for (int32_t t = 0; t < kTile; t += kW) {
    const Vec x = load(p + t);
    top = (lane + t >= lo) & (lane + t < hi) & (x > top) ? x : top;
  }
  const float mx = max_lane<kW / 2>(top);
  float sum = 0.f;
  for (int64_t t = 0; t < kTile; ++t) {
    p[t] = t >= from && t < cnt ? fast_exp(p[t] - mx) : 0.f;
    sum += p[t];
  }
  const float alpha = fast_exp(m - mx);  // ~0 on the first tile, where m is -inf
  m = mx;
  l = l * alpha + sum;
  // kVecs vectors of the output at a time, each as two running sums (even and odd keys) held in
  // registers across the tile, so that one vector's FMAs do not wait on each other.
  for (int64_t x = 0; x < P; x += kVecs * kW) {
    Vec even[kVecs], odd[kVecs];
    for (int c = 0; c < kVecs; ++c) even[c] = load(a + x + c * kW) * alpha, odd[c] = Vec{};
    int64_t t = from;
    for (; t + 2 <= cnt; t += 2) {
      const float *v0 = v[t] + x, *v1 = v[t + 1] + x;
      for (int c = 0; c < kVecs; ++c) {
        even[c] += p[t] * load(v0 + c * kW);
        odd[c] += p[t + 1] * load(v1 + c * kW);
      }
    }
    if (t < cnt) {
      for (int c = 0; c < kVecs; ++c) even[c] += p[t] * load(v[t] + x + c * kW);
    }
    for (int c = 0; c < kVecs; ++c) store(a + x + c * kW, even[c] + odd[c]);
  }
}

// New tokens [tok, tok + nq) of a row (token i's position: the row's context minus its new
// tokens, plus i), KV head g's query heads. Each tile of keys is read (and converted) once for
// all of them; each query takes the tiles from its window's first key up to its own position.
// fp32 rows of a whole number of kVecs vectors are read in place, any other rows through the
// scratch: one way per dtype and head dim, so every query of a model reads its keys alike.
template <int64_t kD, typename T, typename C>
void attend_queries(const Step<kD, T, C>& c, int64_t row, int64_t tok, int64_t nq, int64_t g,
                    Scratch& w) {
  const int64_t n = c.starts[row + 1] - c.starts[row];
  const int64_t D = c.head_dim(), P = c.padded(), G = c.G;
  const int64_t first = c.lens[row] - n + tok + 1, L = first + nq - 1;  // keys the first, last see
  // Query j sees keys [start(j), first + j): up to its own, and within the window before it.
  auto start = [&](int64_t j) { return std::max<int64_t>(0, first + j - c.window); };
  const int64_t k_begin = start(0) / kTile * kTile;  // tiles before every query's window: skipped
  float *qf = w.q.data(), *acc = w.out.data();
  for (int64_t j = 0; j < nq; ++j) {
    const T* q = c.q + (c.starts[row] + tok + j) * c.q_row + g * G * D;  // the heads adjacent
    for (int64_t h = 0; h < G; ++h) {
      for (int64_t d = 0; d < D; ++d) qf[(j * G + h) * P + d] = to_float(q[h * D + d]) * c.scale;
    }
  }
  std::fill(acc, acc + nq * G * P, 0.f);
  std::fill(w.m.begin(), w.m.begin() + nq * G, -kInf);
  std::fill(w.l.begin(), w.l.begin() + nq * G, 0.f);
  const C* k_tiles[2][kTile];  // this tile's rows and the next one's
  const C* v_tiles[2][kTile];
  c.rows(row, g, k_begin, std::min(kTile, L - k_begin), k_tiles[0], v_tiles[0]);
  constexpr bool kInPlace = std::is_same_v<C, float> && kD && kD == padded_dim(kD);
  const float *k_rows[kTile], *v_rows[kTile];  // in place: this tile's rows
  if constexpr (kInPlace) {
    // Rows past a tile's cnt are read by its last score block (and masked): until a tile sets
    // them, key k_begin's; after, the previous tile's. Rows of this context, never outside the
    // caches.
    std::fill(k_rows, k_rows + kTile, k_tiles[0][0]);
    std::fill(v_rows, v_rows + kTile, v_tiles[0][0]);
  }
  for (int64_t k0 = k_begin, i = 0; k0 < L; k0 += kTile, i ^= 1) {
    const int64_t cnt = std::min(kTile, L - k0), next = std::min(kTile, L - k0 - kTile);
    if (next > 0) {  // ask for the next tile now, so its loads overlap this tile's arithmetic
      c.rows(row, g, k0 + kTile, next, k_tiles[i ^ 1], v_tiles[i ^ 1]);
      c.prefetch(k_tiles[i ^ 1], v_tiles[i ^ 1], next);
    }
    for (int64_t t = 0; t < cnt; ++t) {
      if constexpr (kInPlace) {
        k_rows[t] = k_tiles[i][t], v_rows[t] = v_tiles[i][t];
      } else {
        float *kf = w.k.data() + t * P, *vf = w.v.data() + t * P;
        to_floats(k_tiles[i][t], kf, D);
        to_floats(v_tiles[i][t], vf, D);
      }
    }
    for (int64_t j = 0; j < nq; ++j) {
      if (first + j <= k0) continue;  // this query's keys ended before the tile
      const int64_t from = std::max<int64_t>(0, start(j) - k0);
      if (from >= kTile) continue;  // its window starts after the tile
      const int64_t seen = std::min(kTile, first + j - k0);
      for (int64_t h = 0, x = j * G; h < G; ++h, ++x) {
        if constexpr (kInPlace) {
          attend_tile<kD>(qf + x * P, acc + x * P, w.m[x], w.l[x], InPlace{k_rows},
                          InPlace{v_rows}, from, seen, P, c.softcap);
        } else {
          attend_tile<kD ? padded_dim(kD) : 0>(qf + x * P, acc + x * P, w.m[x], w.l[x],
                                           Packed{w.k.data(), P}, Packed{w.v.data(), P}, from,
                                           seen, P, c.softcap);
        }
      }
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    T* out = c.out + ((c.starts[row] + tok + j) * c.Hq + g * G) * D;
    for (int64_t h = 0, x = j * G; h < G; ++h, ++x) {
      // A sink adds e^(sink - max) to the softmax's sum and nothing to its output: the query's
      // own running max, so its bits still depend on nothing but its own keys.
      const float l = c.sinks ? w.l[x] + std::exp(c.sinks[g * G + h] - w.m[x]) : w.l[x];
      for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<T>(acc[x * P + d] / l);
    }
  }
}

// While a thread attends, denormal results are flushed to zero and denormal inputs read as zero
// (the SSE control register's FTZ and DAZ bits; the thread's own mode is restored after). A key
// scoring far below the row's maximum gets a weight near fast_exp's floor, e^-87 ~ 1.6e-38, and
// its V row times that is a denormal: each one a microcode assist, hundreds of cycles. A head
// whose scores spread by more than ~80 would run several times slower; the products flushed are
// far below what any output can resolve. Every query runs under the same mode, so a token's
// bits still depend on nothing but its own position and keys.
class FlushDenormals {
 public:
#if defined(__SSE2__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFlush); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFlush = 0x8040;  // FTZ (bit 15) and DAZ (bit 6)
  unsigned saved_;
#endif
};

struct Item {
  int64_t row, tok, count, g;
};

template <int64_t kD, typename T, typename C>
void attend_impl(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_rows,
                 double scale, int64_t window, double softcap, const float* sinks) {
  const int64_t Hkv = k_cache.size(2), G = q.size(1) / Hkv, D = q.size(2);
  const Step<kD, T, C> c{q.size(1), D, k_cache.size(1), Hkv, G, block_tables.size(1),
                         q.stride(0), k_cache.size(3), q.data_ptr<T>(), k_cache.data_ptr<C>(),
                         v_cache.data_ptr<C>(),
                      out.data_ptr<T>(), block_tables.data_ptr<int64_t>(),
                      seq_lens.data_ptr<int64_t>(), query_start_loc.data_ptr<int64_t>(),
                      static_cast<float>(scale), window, static_cast<float>(softcap), sinks};
  // Tokens per item: kQueries, or fewer where the step's rows would give its threads too few
  // items to share evenly. A verified row of 7 tokens is one item per KV head, 3 for the
  // default model: at two threads one thread would do 2 and the other 1; in chunks of 4 it is
  // 6, which they share evenly. Each item converts its tiles of keys again, which chunks of 1
  // or 2 tokens do not repay, so only into chunks of at least kMinSplit. A token's bits do not
  // depend on its item.
  constexpr int64_t kMinSplit = 3;
  const int64_t threads = at::get_num_threads(), wanted = 2 * threads, base = num_rows * Hkv;
  int64_t chunk = kQueries;
  if (threads > 1 && base > 0 && base < wanted) {
    int64_t longest = 0;
    for (int64_t r = 0; r < num_rows; ++r) {
      longest = std::max(longest, c.starts[r + 1] - c.starts[r]);
    }
    const int64_t splits = (wanted + base - 1) / base, split = (longest + splits - 1) / splits;
    if (split >= kMinSplit) chunk = std::min(split, kQueries);
  }
  std::vector<Item> items;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t n = c.starts[r + 1] - c.starts[r];
    for (int64_t t = 0; t < n; t += chunk) {
      for (int64_t g = 0; g < Hkv; ++g) items.push_back({r, t, std::min(chunk, n - t), g});
    }
  }
  // One task per thread of torch's pool, each taking the next item until none is left.
  std::atomic<size_t> next{0};
  const int64_t P = c.padded(), heads = kQueries * G;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const FlushDenormals flush;
    Scratch w{std::vector<float>(heads * P), std::vector<float>(heads * P),
              std::vector<float>(heads), std::vector<float>(heads),
              std::vector<float>(kTile * P), std::vector<float>(kTile * P)};
    for (size_t i; (i = next.fetch_add(1)) < items.size();) {
      const Item& it = items[i];
      attend_queries(c, it.row, it.tok, it.count, it.g, w);
    }
  });
}

template <typename T>
void attend_typed(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_rows,
                  double scale, int64_t window, double softcap, const float* sinks) {
  const bool int8 = k_cache.scalar_type() == at::kChar;
  auto run = [&](auto kD) {
    constexpr int64_t d = decltype(kD)::value;
    if (int8) {
      attend_impl<d, T, int8_t>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                query_start_loc, num_rows, scale, window, softcap, sinks);
    } else {
      attend_impl<d, T, T>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                           num_rows, scale, window, softcap, sinks);
    }
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
  const auto cache = k_cache.scalar_type() == at::kChar ? at::kChar : dtype;  // int8, or q's
  check_array("paged_attention", "k_cache", k_cache, cache);
  check_array("paged_attention", "v_cache", v_cache, cache);
  const int64_t row = cache == at::kChar ? tinyllm::int8_row(q.size(2)) : q.size(2);
  TORCH_CHECK(out.sizes() == q.sizes(), "paged_attention: out ", out.sizes(), " must be q's ",
              q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(1) > 0 && k_cache.size(2) > 0 &&
                  k_cache.size(3) == row,
              "paged_attention: k_cache ", k_cache.sizes(), " must be (blocks, block_size >= 1, "
              "kv_heads >= 1, ", row, ": q's head_dim ", q.size(2),
              cache == at::kChar ? " plus its int8 scales" : "", ")");
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
// copied to its cache slot, or into an int8 cache quantized head by head (quantize_row). N: q's
// tokens; k and v of q's dtype.
void write_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& slot_mapping, int64_t n,
                 at::ScalarType dtype) {
  const int64_t D = tinyllm::cache_head_dim(k_cache);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == dtype,
                "paged_attention: k and v must be on the CPU, of q's dtype ", dtype);
    TORCH_CHECK(t->dim() == 3 && t->size(0) == n && t->size(1) == k_cache.size(2) &&
                    t->size(2) == D && t->stride(2) == 1 &&
                    t->stride(1) == t->size(2),
                "paged_attention: k ", k.sizes(), " and v ", v.sizes(), " must be [", n, ", ",
                k_cache.size(2), ", ", D,
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
  if (k_cache.scalar_type() == at::kChar) {
    const int64_t H = k.size(1), row = k_cache.size(3);
    auto quantize = [&](auto* x) {
      using T = std::remove_pointer_t<decltype(x)>;
      for (auto [src, dst] : {std::pair{&k, &k_cache}, std::pair{&v, &v_cache}}) {
        const T* s = src->template data_ptr<T>();
        int8_t* c = dst->template data_ptr<int8_t>();
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t h = 0; h < H; ++h) {
            quantize_row(s + t * src->stride(0) + h * D, c + (slot[t] * H + h) * row, D);
          }
        }
      }
    };
    if (dtype == at::kFloat) return quantize(static_cast<float*>(nullptr));
    return quantize(static_cast<c10::BFloat16*>(nullptr));
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
// With a sliding window, the query at position p attends to keys max(0, p - window + 1)..p.
// With `softcap`, each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2's). With
// `sinks` (a logit per query head, gpt-oss's), each softmax's sum also counts e^sink.
void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const std::optional<at::Tensor>& k,
                     const std::optional<at::Tensor>& v,
                     const std::optional<at::Tensor>& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, int64_t num_rows, double scale,
                     std::optional<int64_t> window, std::optional<double> softcap,
                     const std::optional<at::Tensor>& sinks) {
  check_step(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_rows);
  TORCH_CHECK(k.has_value() == v.has_value() && k.has_value() == slot_mapping.has_value(),
              "paged_attention: k, v and slot_mapping come together");
  TORCH_CHECK(!window || *window >= 1, "paged_attention: window ", window.value_or(0),
              " must be >= 1 (a query sees at least itself)");
  TORCH_CHECK(!softcap || *softcap > 0, "paged_attention: softcap ", softcap.value_or(0),
              " must be > 0");
  TORCH_CHECK(!sinks || (sinks->dim() == 1 && sinks->size(0) == q.size(1)),
              "paged_attention: sinks ", sinks ? sinks->sizes() : at::IntArrayRef{},
              " must be [", q.size(1), "], one per query head");
  const at::Tensor sink_logits = sinks ? sinks->to(at::kFloat).contiguous() : at::Tensor();
  const float* sink = sinks ? sink_logits.data_ptr<float>() : nullptr;
  const int64_t keys = window.value_or(std::numeric_limits<int64_t>::max());
  const double cap = softcap.value_or(0);
  if (k) write_cache(k_cache, v_cache, *k, *v, *slot_mapping, q.size(0), q.scalar_type());
  if (q.scalar_type() == at::kFloat) {
    attend_typed<float>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                        num_rows, scale, keys, cap, sink);
  } else {
    attend_typed<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                query_start_loc, num_rows, scale, keys, cap, sink);
  }
}

}  // namespace tinyllm

// A torch op rather than a pybind11 module: torch/library.h compiles in a fraction of the
// time torch/extension.h takes.
TORCH_LIBRARY(tinyllm, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor(b!) k_cache, Tensor(c!) v_cache, "
      "Tensor? k, Tensor? v, Tensor? slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, int num_rows, float scale, int? window=None, "
      "float? softcap=None, Tensor? sinks=None) -> ()",
      &tinyllm::paged_attention);
}
