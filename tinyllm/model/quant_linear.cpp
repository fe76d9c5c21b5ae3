// y = x W^T for W quantized in blocks of 32 weights (4 or 8 bits), run as llama.cpp runs GGUF
// files: each call quantizes the activations to integers per block of 32, then every block's
// dot product is integer multiply-adds (AVX512-VNNI's vpdpbusd: 64 u8 x s8 products a step),
// scaled once per block:
//   sum_k w[k] x[k] = sum_blocks  d sum(u x)  +  m sum(x)      for w = d u + m.
// Unlike llama.cpp, an activation is two int8 codes, x = dx (q1 + q2 / 254): q1 rounds x on the
// block's grid (dx = max|x| / 127), q2 rounds what q1 left, 254 times finer. One int8 code
// alone costs the small values of a block with a large one most of their bits, which flipped
// near-tied greedy tokens of the default model; two are exact to about 15 bits, and at one
// row, where the weights' bytes bound the time, the second pass is nearly free.
// torch's own int4 kernel unpacks every weight to a float first and is bound by that, not by
// memory; this one reads each weight byte once and does a few instructions per 32 weights.
//
// Layout (model/quant.py packs it, in torch): output rows in tiles of 16, so the 16 lanes of a
// vector hold 16 output rows and no horizontal sum is ever needed. For tile t and block b, one
// record of codes then the 16 rows' fp16 d and fp16 m:
// - 4 bits: 4 chunks of 64 bytes; chunk c, byte 4r + j holds row r's weight 8c + j in its low
//   nibble and 8c + 4 + j in its high one (so a chunk is two vpdpbusd operands after a mask).
// - 8 bits: 8 chunks; chunk c, byte 4r + j holds row r's weight 4c + j, as u = q + 128.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 16;   // output rows per tile
constexpr int64_t kBlock = 32;  // weights per scale
constexpr float kFine = 254.f;  // q2's grid: 254 steps to one of q1's (|x - dx q1| <= dx / 2)
constexpr int kMaxRows = 4;     // activation rows sharing one pass over a tile's codes
// Records fetched ahead of use, into L2: at one activation row the kernel is bound by memory,
// and the hardware prefetcher alone left a third of the bandwidth unused. Into L2 rather than
// L1 (16 ahead, before), a 1B model's decode linears ran 15-20% faster per thread
// (docs/INFERENCE.md, "Real model shapes"), likely as more lines can be in flight to L2 than
// the L1's few miss buffers hold; the kernel's own loads then find them in L2.
constexpr int64_t kAhead = 32;

constexpr int64_t code_bytes(int bits) { return kRows * kBlock * bits / 8; }
constexpr int64_t record_bytes(int bits) { return code_bytes(bits) + 2 * kRows * 2; }

// Activations as int8 blocks: row i's block b is q[(i * blocks + b) * 64 ...], q1 then q2 (32
// codes each), its scale d[i * blocks + b] and s = its sum(x), which multiplies the weights' m.
struct Quantized {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t blocks;
};

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int64_t blocks, int8_t* q, float* d,
                   float* s) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    float v[kBlock];
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t b = 0; b < blocks; ++b) {
        float amax = 0.f;
        for (int64_t j = 0; j < kBlock; ++j) {
          const int64_t col = b * kBlock + j;
          v[j] = col < k ? static_cast<float>(x[i * k + col]) : 0.f;  // zeros past K
          amax = std::max(amax, std::fabs(v[j]));
        }
        const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum1 = 0, sum2 = 0;
        int8_t *q1 = q + (i * blocks + b) * 2 * kBlock, *q2 = q1 + kBlock;
        for (int64_t j = 0; j < kBlock; ++j) {
          const float coarse = std::nearbyint(v[j] * inv);
          q1[j] = static_cast<int8_t>(coarse);
          q2[j] = static_cast<int8_t>(std::nearbyint((v[j] * inv - coarse) * kFine));
          sum1 += q1[j];
          sum2 += q2[j];
        }
        d[i * blocks + b] = scale;
        s[i * blocks + b] = scale * (static_cast<float>(sum1) + static_cast<float>(sum2) / kFine);
      }
    }
  });
}

#if defined(__AVX2__)
template <int BITS>
inline void prefetch(const uint8_t* rec) {
  const char* ahead = reinterpret_cast<const char*>(rec + kAhead * record_bytes(BITS));
  for (int64_t line = 0; line < record_bytes(BITS); line += 64) {
    _mm_prefetch(ahead + line, _MM_HINT_T1);
  }
}
#endif

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512VNNI__)

// Rows [0, R) of the activations against one tile: acc[r][lane] = y[r][tile row lane].
template <int BITS, int R>
void tile_dot(const uint8_t* tile, const Quantized& x, float (*acc)[kRows]) {
  __m512 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* rec = tile + b * record_bytes(BITS);
    prefetch<BITS>(rec);
    __m512i w[8];  // w[c]: the 16 rows' weights 4c .. 4c + 3 of this block, as u8
    for (int c = 0; c < 8; ++c) {
      if constexpr (BITS == 4) {
        const __m512i v = _mm512_loadu_si512(rec + 64 * (c / 2));
        w[c] = _mm512_and_si512(c % 2 ? _mm512_srli_epi16(v, 4) : v, low);
      } else {
        w[c] = _mm512_loadu_si512(rec + 64 * c);
      }
    }
    const uint8_t* scales = rec + code_bytes(BITS);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
    const __m512 m =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
    for (int r = 0; r < R; ++r) {
      const int8_t* q = x.q + (r * x.blocks + b) * 2 * kBlock;
      // A chain per code and parity, so consecutive multiply-adds do not wait on each other.
      __m512i dots[2][2] = {};
      for (int c = 0; c < 8; ++c) {
        for (int fine = 0; fine < 2; ++fine) {
          const __m512i qx = _mm512_set1_epi32(load_i32(q + fine * kBlock + 4 * c));
          dots[fine][c % 2] = _mm512_dpbusd_epi32(dots[fine][c % 2], w[c], qx);
        }
      }
      const __m512 coarse = _mm512_cvtepi32_ps(_mm512_add_epi32(dots[0][0], dots[0][1]));
      const __m512 fine = _mm512_cvtepi32_ps(_mm512_add_epi32(dots[1][0], dots[1][1]));
      const __m512 dot = _mm512_fmadd_ps(fine, _mm512_set1_ps(1.f / kFine), coarse);
      const int64_t i = r * x.blocks + b;
      sum[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(x.d[i])), sum[r]);
      sum[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[i]), sum[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc[r], sum[r]);
}

#elif defined(__AVX2__)

// Eight lanes of u8 x s8 products, summed in fours into int32.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else  // the pairs' int16 sums cannot saturate: u <= 15 here (8-bit codes take dot_s8s8)
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// s8 x s8 for 8-bit codes u = q + 128 without VNNI: |qx| * (q with qx's sign), whose pairs fit
// in int16 (2 * 127 * 127); the caller adds back the 128 d per weight that q leaves out.
inline __m256i dot_s8s8(__m256i acc, __m256i u, __m256i s) {
  const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(s), _mm256_sign_epi8(q, s));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

#if defined(__AVXVNNI__)
constexpr bool kSigned8 = false;
#else
constexpr bool kSigned8 = true;
#endif

// As the AVX512 version, with each 64-byte chunk as two 8-row halves.
template <int BITS, int R>
void tile_dot(const uint8_t* tile, const Quantized& x, float (*acc)[kRows]) {
  constexpr bool s8 = BITS == 8 && kSigned8;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int half = 0; half < 2; ++half) {
    __m256 sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < x.blocks; ++b) {
      const uint8_t* rec = tile + b * record_bytes(BITS);
      if (half == 0) prefetch<BITS>(rec);
      __m256i w[8];
      for (int c = 0; c < 8; ++c) {
        const int chunk = BITS == 4 ? c / 2 : c;
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * chunk + 32 * half));
        w[c] = BITS == 4 ? _mm256_and_si256(c % 2 ? _mm256_srli_epi16(v, 4) : v, low) : v;
      }
      const uint8_t* scales = rec + code_bytes(BITS) + 16 * half;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
      __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 32)));
      if (s8) m = _mm256_fmadd_ps(d, _mm256_set1_ps(128.f), m);
      for (int r = 0; r < R; ++r) {
        const int8_t* q = x.q + (r * x.blocks + b) * 2 * kBlock;
        __m256i dots[2][2] = {};
        for (int c = 0; c < 8; ++c) {
          for (int fine = 0; fine < 2; ++fine) {
            const __m256i qx = _mm256_set1_epi32(load_i32(q + fine * kBlock + 4 * c));
            __m256i& acc = dots[fine][c % 2];
            acc = s8 ? dot_s8s8(acc, w[c], qx) : dot_u8s8(acc, w[c], qx);
          }
        }
        const __m256 coarse = _mm256_cvtepi32_ps(_mm256_add_epi32(dots[0][0], dots[0][1]));
        const __m256 fine = _mm256_cvtepi32_ps(_mm256_add_epi32(dots[1][0], dots[1][1]));
        const __m256 dot = _mm256_fmadd_ps(fine, _mm256_set1_ps(1.f / kFine), coarse);
        const int64_t i = r * x.blocks + b;
        sum[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(x.d[i])), sum[r]);
        sum[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s[i]), sum[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc[r] + 8 * half, sum[r]);
  }
}

#else

// Portable: the same arithmetic one weight at a time.
template <int BITS, int R>
void tile_dot(const uint8_t* tile, const Quantized& x, float (*acc)[kRows]) {
  for (int r = 0; r < R; ++r) std::fill(acc[r], acc[r] + kRows, 0.f);
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* rec = tile + b * record_bytes(BITS);
    const c10::Half* scales = reinterpret_cast<const c10::Half*>(rec + code_bytes(BITS));
    for (int64_t row = 0; row < kRows; ++row) {
      for (int r = 0; r < R; ++r) {
        const int8_t* q = x.q + (r * x.blocks + b) * 2 * kBlock;
        int32_t coarse = 0, fine = 0;
        for (int64_t j = 0; j < kBlock; ++j) {
          const int64_t quad = j / 4;
          int32_t u;
          if (BITS == 4) {
            const uint8_t byte = rec[64 * (quad / 2) + 4 * row + j % 4];
            u = quad % 2 ? byte >> 4 : byte & 0x0F;
          } else {
            u = rec[64 * quad + 4 * row + j % 4];
          }
          coarse += u * q[j];
          fine += u * q[kBlock + j];
        }
        const float dot = static_cast<float>(coarse) + static_cast<float>(fine) / kFine;
        const int64_t i = r * x.blocks + b;
        acc[r][row] += dot * static_cast<float>(scales[row]) * x.d[i] +
                       static_cast<float>(scales[kRows + row]) * x.s[i];
      }
    }
  }
}

#endif

template <int BITS, typename T>
void run_tiles(const uint8_t* packed, const Quantized& x, T* y, int64_t rows, int64_t n) {
  const int64_t tiles = (n + kRows - 1) / kRows, tile_bytes = x.blocks * record_bytes(BITS);
  // Tiles per task: at least ~64K multiply-adds, so a small layer at one row is not split
  // into tasks that cost more to start than to run. rows and blocks are >= 1: quant_linear
  // returns before calling with none.
  const int64_t grain = std::max<int64_t>(1, 65536 / (kRows * kBlock * x.blocks * rows));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    float acc[kMaxRows][kRows];
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = packed + t * tile_bytes;
      const int64_t width = std::min(kRows, n - t * kRows);
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
        Quantized part = x;
        part.q += r0 * x.blocks * 2 * kBlock;
        part.d += r0 * x.blocks;
        part.s += r0 * x.blocks;
        switch (std::min<int64_t>(kMaxRows, rows - r0)) {
          case 1: tile_dot<BITS, 1>(tile, part, acc); break;
          case 2: tile_dot<BITS, 2>(tile, part, acc); break;
          case 3: tile_dot<BITS, 3>(tile, part, acc); break;
          default: tile_dot<BITS, 4>(tile, part, acc); break;
        }
        for (int64_t r = 0; r < std::min<int64_t>(kMaxRows, rows - r0); ++r) {
          T* out = y + (r0 + r) * n + t * kRows;
          for (int64_t lane = 0; lane < width; ++lane) out[lane] = static_cast<T>(acc[r][lane]);
        }
      }
    }
  });
}

}  // namespace

namespace tinyllm {

// x (..., K) fp32 or bf16, packed (tiles, blocks, record bytes) -> y (..., n) in x's dtype.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8, not ", bits);
  check_array("quant_linear", "x", x, x.scalar_type());
  check_array("quant_linear", "packed", packed, at::kByte);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "quant_linear: x ", x.sizes(),
              " must have a last dim of at least 1 input feature");
  TORCH_CHECK(n >= 0, "quant_linear: n (output features) must be >= 0, not ", n);
  const int64_t k = x.size(-1), rows = x.numel() / k, blocks = (k + kBlock - 1) / kBlock;
  const std::vector<int64_t> fits{(n + kRows - 1) / kRows, blocks, record_bytes(bits)};
  TORCH_CHECK(packed.sizes() == at::IntArrayRef(fits), "quant_linear: packed weights ",
              packed.sizes(), " do not fit ", n, " outputs of ", k, " inputs at ", bits,
              " bits, which need ", at::IntArrayRef(fits));
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options());
  if (rows == 0 || n == 0) return y;  // e.g. a step with no row to sample: nothing to compute
  at::Tensor q = at::empty({rows * blocks * 2 * kBlock}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({2, rows * blocks}, x.options().dtype(at::kFloat));
  float *d = scales.data_ptr<float>(), *s = d + rows * blocks;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quant_linear", [&] {
    quantize_rows(x.data_ptr<scalar_t>(), rows, k, blocks, q.data_ptr<int8_t>(), d, s);
    const Quantized xq{q.data_ptr<int8_t>(), d, s, blocks};
    const uint8_t* w = packed.data_ptr<uint8_t>();
    if (bits == 4) {
      run_tiles<4>(w, xq, y.data_ptr<scalar_t>(), rows, n);
    } else {
      run_tiles<8>(w, xq, y.data_ptr<scalar_t>(), rows, n);
    }
  });
  return y;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                  int64_t n) {
  TORCH_CHECK(w.dim() >= 1, "linear: weight ", w.sizes(), " has no dims");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n), "linear: bias ", bias->sizes(),
              " must be [", n, "], one per output");
  if (w.scalar_type() != at::kByte) {
    TORCH_CHECK(w.dim() == 2 && w.size(0) == n, "linear: dense weight ", w.sizes(), " must have ",
                n, " output rows");
    return at::linear(x, w, bias);
  }
  at::Tensor y = quant_linear(x, w, n, w.size(-1) == record_bytes(4) ? 4 : 8);
  return bias ? y.add_(*bias) : y;
}

}  // namespace tinyllm

TORCH_LIBRARY_FRAGMENT(tinyllm, m) {
  m.def("quant_linear(Tensor x, Tensor packed, int n, int bits) -> Tensor", &tinyllm::quant_linear);
}
