// y = x W^T for W quantized in blocks of 32 weights (4 or 8 bits), run as llama.cpp runs GGUF
// files: each call quantizes the activations to integers per block of 32, then every block's
// dot product is integer multiply-adds (AVX512-VNNI's vpdpbusd: 64 u8 x s8 products a step),
// scaled once per block:
//   sum_k w[k] x[k] = sum_blocks  d sum(u x)  +  m sum(x)      for w = d u + m.
// Unlike llama.cpp, an activation is two int8 codes, x = dx (q1 + q2 / 254): q1 rounds x on the
// block's grid (dx = max|x| / 127), q2 rounds what q1 left, 254 times finer. One int8 code
// alone costs the small values of a block with a large one most of their bits, which flips
// near-tied greedy tokens of the default model; two are exact to about 15 bits, and at one
// row, where the weights' bytes bound the time, the second pass is nearly free.
// torch's own int4 kernel unpacks every weight to a float first and is bound by that, not by
// memory; this one reads each weight byte once and does a few instructions per 32 weights.
// With AMX, calls of 5 rows and more (verifying drafts, batches, prefill) take each block's
// integer dots as tile products, faster and with the same bits.
// Many rows (prompts, batches) run as a blocked matrix product: each task takes the rows in
// slices whose codes stay in L2, a tile's blocks in spans that stay in L1, and groups of 4 rows
// against a span in registers, the 16 output rows in a vector's lanes, each weight chunk
// unpacked once for the group. Every output still sums its blocks in order with the same float
// steps, so a row's bits never depend on the rows that share its call.
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
#if defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kRows = 16;   // output rows per tile
constexpr int64_t kBlock = 32;  // weights per scale
constexpr float kFine = 254.f;  // q2's grid: 254 steps to one of q1's (|x - dx q1| <= dx / 2)
constexpr int kMaxRows = 4;     // activation rows sharing one pass over a tile's codes
constexpr int64_t kSliceBytes = 512 << 10;  // activation codes a task holds in L2 at a time
constexpr int64_t kSpanBlocks = 64;         // a tile's blocks a task holds in L1 at a time
// Records fetched ahead of use, into L2: at one activation row the kernel is bound by memory,
// and the hardware prefetcher alone leaves part of the bandwidth unused. Into L2 rather than
// L1, because a model's decode linears run faster per thread that way
// (docs/MEASUREMENTS.md, "Real model shapes"), likely as more lines can be in flight to L2 than
// the L1's few miss buffers hold; the kernel's own loads then find them in L2.
constexpr int64_t kAhead = 32;

constexpr int64_t code_bytes(int bits) { return kRows * kBlock * bits / 8; }
constexpr int64_t record_bytes(int bits) { return code_bytes(bits) + 2 * kRows * 2; }

// Activations as int8 blocks, in groups of 8 rows: group g's block b holds its rows' codes
// side by side (row i's at q[((i / 8 * blocks + b) * 8 + i % 8) * 64 ...], q1 then q2, 32 codes
// each), so that one block of a group is one AMX tile (32 bytes a row), and a few rows' codes
// stream from consecutive addresses block after block. Row i's block b has the scale
// d[i * blocks + b] and s = its sum(x), which multiplies the weights' m.
constexpr int64_t kGroup = 8;
struct Quantized {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t blocks;
  int64_t first;  // the call's row that is row 0 here: d and s start at it, q at row 0
};

// Row r's codes of block b: q1 then q2.
inline const int8_t* codes(const Quantized& x, int64_t r, int64_t b) {
  const int64_t i = x.first + r;
  return x.q + ((i / kGroup * x.blocks + b) * kGroup + i % kGroup) * 2 * kBlock;
}

// The bytes from a row's codes of one block to the next.
constexpr int64_t kCodeStride = kGroup * 2 * kBlock;

// A call's activations from `first` on.
inline Quantized from_row(const Quantized& x, int64_t first) {
  return {x.q, x.d + first * x.blocks, x.s + first * x.blocks, x.blocks, x.first + first};
}

// One block of 32 activations (zeros past K) to its codes, scale and sum. The loops have fixed
// trip counts and no branches, so that they vectorize.
inline void quantize_block(const float* __restrict v, int8_t* __restrict q1,
                           int8_t* __restrict q2, float* __restrict d, float* __restrict s) {
  // The largest |v| as an integer max over the values' bits without their signs, which orders
  // them as their magnitudes (a float max does not vectorize, for NaN's sake). A NaN's bits are
  // above every number's, so a block with one gets a NaN scale and its row NaN outputs, as a
  // float matrix product gives (its code alone would be some integer, the outputs plausible).
  int32_t top = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    int32_t bits;
    std::memcpy(&bits, v + j, sizeof bits);
    top = std::max(top, bits & 0x7FFFFFFF);
  }
  float amax;
  std::memcpy(&amax, &top, sizeof amax);
  const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  // The codes as int32 first (|code| <= 127, so each narrows exactly): the sums then add them
  // as they are, where reading the int8 codes back cost as much as making them.
  alignas(64) int32_t c1[kBlock], c2[kBlock];
  for (int64_t j = 0; j < kBlock; ++j) {
    const float coarse = std::nearbyint(v[j] * inv);
    c1[j] = static_cast<int32_t>(coarse);
    c2[j] = static_cast<int32_t>(std::nearbyint((v[j] * inv - coarse) * kFine));
  }
  for (int64_t j = 0; j < kBlock; ++j) {
    q1[j] = static_cast<int8_t>(c1[j]);
    q2[j] = static_cast<int8_t>(c2[j]);
  }
  int32_t sum1 = 0, sum2 = 0;
  for (int64_t j = 0; j < kBlock; ++j) sum1 += c1[j], sum2 += c2[j];
  *d = scale;
  *s = scale * (static_cast<float>(sum1) + static_cast<float>(sum2) / kFine);
}

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int64_t blocks, int8_t* q, float* d,
                   float* s) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float v[kBlock];
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t b = 0; b < blocks; ++b) {
        const T* in = x + i * k + b * kBlock;
        if ((b + 1) * kBlock <= k) {
          for (int64_t j = 0; j < kBlock; ++j) v[j] = static_cast<float>(in[j]);
        } else {
          for (int64_t j = 0; j < kBlock; ++j) {
            v[j] = b * kBlock + j < k ? static_cast<float>(in[j]) : 0.f;  // zeros past K
          }
        }
        int8_t* q1 = q + ((i / kGroup * blocks + b) * kGroup + i % kGroup) * 2 * kBlock;
        quantize_block(v, q1, q1 + kBlock, d + i * blocks + b, s + i * blocks + b);
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
void tile_dot(const uint8_t* tile, const Quantized& x, int64_t b0, int64_t b1,
              float (*acc)[kRows]) {
  __m512 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm512_loadu_ps(acc[r]);
  const int8_t* row[R];  // each row's codes of block 0
  for (int r = 0; r < R; ++r) row[r] = codes(x, r, 0);
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = b0; b < b1; ++b) {
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
      const int8_t* q = row[r] + b * kCodeStride;
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

#if defined(__AMX_INT8__)

// AMX (Sapphire Rapids and later): one block's integer dots for up to 8 activation rows, their
// q1 and q2 as 16 rows of a tile, against a tile's 16 output rows in one tile product (TDPBSUD:
// s8 x u8, summed in fours into int32), where the VNNI path takes 16 vpdpbusd a row. Integer sums
// are exact either way, and each row's float steps after them are the VNNI path's, in the same
// order, so a row's outputs have the same bits whichever path ran it: verifying drafts or
// prefilling beside other rows never changes a token.
constexpr int64_t kAmxRows = 8;  // activation rows per tile product (q1 and q2: 16 tile rows)
// Fewer rows than this take the VNNI path, which is faster for so few (a tile product's loads
// and store cost about what 4 rows' vpdpbusd do): a call of fewer rows, and the rest of a
// call's rows past its groups of 8.
constexpr int64_t kAmxMinRows = 5;

// Linux lends a process the tile registers only once it asks (arch_prctl); false if refused.
bool amx_permitted() {
  constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
  static const bool ok = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: products (2R rows of 16 int32: row r's q1, then its q2, against 16 output rows) in 0
// and 3; activation codes (2R rows of 32) in 1 and 4; weights (8 rows of 16 output rows x 4
// weights: the records' chunk layout) in 2 and 5. Two of each, so one block's product runs
// while the next one's tiles load. 6 and 7: products and codes of the last, partial group of
// rows (`rest` of them) when more than 8 rows come in groups of 8.
void configure_tiles(int64_t first, int64_t rest) {
  TileConfig cfg;
  const auto set = [&](int tile, int64_t rows, int bytes) {
    cfg.rows[tile] = static_cast<uint8_t>(rows);
    cfg.colsb[tile] = static_cast<uint16_t>(bytes);
  };
  for (int tile : {0, 3, 6}) set(tile, 2 * (tile == 6 ? rest : first), kRows * 4);
  for (int tile : {1, 4, 7}) set(tile, 2 * (tile == 7 ? rest : first), kBlock);
  for (int tile : {2, 5}) set(tile, kBlock / 4, kRows * 4);
  if (rest == 0) set(6, 0, 0), set(7, 0, 0);
  // GCC's _tile_loadconfig tells the compiler it reads only the first 8 bytes, so the stores
  // above could be dropped as dead: the barrier says the asm may read all of cfg.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// One block's products for one group of rows: codes (2R rows of 32 bytes) x weights, left in
// the PRODUCT tile. Macros: GCC's tile intrinsics take the tiles' numbers as literals.
#define TILE_PRODUCT(PRODUCT, CODES, WEIGHTS, codes, weights) \
  do {                                                        \
    _tile_loadd(WEIGHTS, weights, kRows * 4);                 \
    _tile_loadd(CODES, codes, kBlock);                        \
    _tile_zero(PRODUCT);                                      \
    _tile_dpbsud(PRODUCT, CODES, WEIGHTS);                    \
  } while (0)
#define TILE_STORE(PRODUCT, out) _tile_stored(PRODUCT, out, kRows * 4)

constexpr int64_t kAmxBlocks = 8;  // blocks whose products are taken before any is read back
constexpr int64_t kOperandBytes = kBlock * kRows;  // a block's weights as a tile operand

// A record's codes as a tile operand (8 rows of 64 bytes, a byte a weight) at `out`, aligned:
// 4-bit chunk c's low nibbles are the operand's row 2c (weights 8c .. 8c + 3 of each output
// row), its high nibbles row 2c + 1; 8-bit chunks are its rows as they are, copied (vector
// loads, then a tile load, beat tile loads straight from the streamed records).
template <int BITS>
inline void tile_operand(const uint8_t* rec, uint8_t* out) {
  prefetch<BITS>(rec);
  if constexpr (BITS == 4) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(rec + 64 * c);
      _mm512_store_si512(out + 128 * c, _mm512_and_si512(v, low));
      _mm512_store_si512(out + 128 * c + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
  } else {
    for (int c = 0; c < 8; ++c) _mm512_store_si512(out + 64 * c, _mm512_loadu_si512(rec + 64 * c));
  }
}

// R (<= 8) rows against one tile: acc[r][lane] = y[r][tile row lane]. Its blocks' tile operands
// are at operands + b * kOperandBytes, or, given nullptr, made here from the records. R a
// constant, so that the rows' sums stay in registers; tiles 0-5 hold R-row products
// (configure_tiles), 6 and 7 `rest`-row ones, used when R is the last, partial group of rows.
template <int BITS, int R>
void tile_dot_amx(const uint8_t* tile, const uint8_t* operands, const Quantized& x, bool rest,
                  float (*acc)[kRows]) {
  __m512 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_ps();
  alignas(64) int32_t dots[kAmxBlocks][2 * R][kRows];
  alignas(64) uint8_t own[kAmxBlocks][kOperandBytes];
  for (int64_t b0 = 0; b0 < x.blocks; b0 += kAmxBlocks) {
    const int64_t group = std::min(kAmxBlocks, x.blocks - b0);
    const uint8_t* weights = operands ? operands + b0 * kOperandBytes : own[0];  // the group's
    if (operands == nullptr) {  // made here, a group at a time, as the records stream in
      for (int64_t g = 0; g < group; ++g) {
        tile_operand<BITS>(tile + (b0 + g) * record_bytes(BITS), own[g]);
      }
    }
    if (rest) {
      for (int64_t g = 0; g < group; ++g) {
        TILE_PRODUCT(6, 7, 2, codes(x, 0, b0 + g), weights + g * kOperandBytes);
        TILE_STORE(6, dots[g][0]);
      }
    } else {  // two blocks' products under way before either is stored
      for (int64_t g = 0; g < group; g += 2) {
        const bool pair = g + 1 < group;
        TILE_PRODUCT(0, 1, 2, codes(x, 0, b0 + g), weights + g * kOperandBytes);
        if (pair) TILE_PRODUCT(3, 4, 5, codes(x, 0, b0 + g + 1), weights + (g + 1) * kOperandBytes);
        TILE_STORE(0, dots[g][0]);
        if (pair) TILE_STORE(3, dots[g + 1][0]);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const int64_t b = b0 + g;
      const uint8_t* scales = tile + b * record_bytes(BITS) + code_bytes(BITS);
      const __m512 d =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
      const __m512 m =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
      for (int r = 0; r < R; ++r) {  // as the VNNI path, step for step
        const __m512 coarse = _mm512_cvtepi32_ps(_mm512_load_si512(dots[g][2 * r]));
        const __m512 fine = _mm512_cvtepi32_ps(_mm512_load_si512(dots[g][2 * r + 1]));
        const __m512 dot = _mm512_fmadd_ps(fine, _mm512_set1_ps(1.f / kFine), coarse);
        const int64_t i = r * x.blocks + b;
        sum[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(x.d[i])), sum[r]);
        sum[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[i]), sum[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc[r], sum[r]);
}

template <int BITS, typename T>
void run_tiles_amx(const uint8_t* packed, const Quantized& x, T* y, int64_t rows, int64_t n) {
  const int64_t tiles = (n + kRows - 1) / kRows, tile_bytes = x.blocks * record_bytes(BITS);
  const int64_t first = std::min(rows, kAmxRows), last = rows > kAmxRows ? rows % kAmxRows : 0;
  const int64_t rest = last >= kAmxMinRows ? last : 0;  // rows for tiles 6 and 7
  const int64_t grain = std::max<int64_t>(1, 65536 / (kRows * kBlock * x.blocks * rows));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    configure_tiles(first, rest);
    // With more than 8 rows, a tile's operands are made once and read by every group of rows;
    // with fewer, each group of blocks as it comes (nullptr).
    const bool once = rows > kAmxRows;
    std::vector<uint8_t> operands(once ? x.blocks * kOperandBytes + 64 : 0);
    uint8_t* aligned = operands.data() + (-reinterpret_cast<uintptr_t>(operands.data()) & 63);
    float acc[kAmxRows][kRows];
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = packed + t * tile_bytes;
      if (once) {
        for (int64_t b = 0; b < x.blocks; ++b) {
          tile_operand<BITS>(tile + b * record_bytes(BITS), aligned + b * kOperandBytes);
        }
      }
      const uint8_t* weights = once ? aligned : nullptr;
      const int64_t width = std::min(kRows, n - t * kRows);
      for (int64_t r0 = 0; r0 < rows; r0 += kAmxRows) {
        const int64_t count = std::min(kAmxRows, rows - r0);
        const Quantized part = from_row(x, r0);
        const bool partial = count < first;
        if (count < kAmxMinRows) std::fill(acc[0], acc[count], 0.f);  // tile_dot adds to acc
        switch (count) {
          case 1: tile_dot<BITS, 1>(tile, part, 0, x.blocks, acc); break;
          case 2: tile_dot<BITS, 2>(tile, part, 0, x.blocks, acc); break;
          case 3: tile_dot<BITS, 3>(tile, part, 0, x.blocks, acc); break;
          case 4: tile_dot<BITS, 4>(tile, part, 0, x.blocks, acc); break;
          case 5: tile_dot_amx<BITS, 5>(tile, weights, part, partial, acc); break;
          case 6: tile_dot_amx<BITS, 6>(tile, weights, part, partial, acc); break;
          case 7: tile_dot_amx<BITS, 7>(tile, weights, part, partial, acc); break;
          default: tile_dot_amx<BITS, 8>(tile, weights, part, partial, acc); break;
        }
        for (int64_t r = 0; r < count; ++r) {
          T* out = y + (r0 + r) * n + t * kRows;
          for (int64_t lane = 0; lane < width; ++lane) out[lane] = static_cast<T>(acc[r][lane]);
        }
      }
    }
    _tile_release();
  });
}

#endif  // __AMX_INT8__

#elif defined(__AVX2__)

#if defined(__AVXVNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// One chunk's products of weights u and activation codes s added into acc, eight output rows'
// lanes: with VNNI, u8 x s8 summed in fours into int32. Without: 4-bit codes' u8 x s8 pairs
// summed in int16 (a pair is at most 2 * 15 * 127, so a block's 8 chunks fit), widened to int32
// once a block by `widen`, the same integers as widening each chunk's in a third of the
// instructions; 8-bit codes u = q + 128 as s8 x s8, |s| * (q with s's sign), whose pairs fit in
// int16 (2 * 127 * 127) but not 8 of them, so widened at once (the caller adds back the 128 d
// per weight that q leaves out).
template <int BITS>
inline __m256i accumulate(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  if constexpr (BITS == 4) return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
  const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(s), _mm256_sign_epi8(q, s));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// A block's sums from `accumulate` as int32.
template <int BITS>
inline __m256i widen(__m256i acc) {
  return BITS == 4 && !kVnni ? _mm256_madd_epi16(acc, _mm256_set1_epi16(1)) : acc;
}

// As the AVX512 version, with each 64-byte chunk as two 8-row halves, and a chunk's weights
// unpacked once for all R rows.
template <int BITS, int R>
void tile_dot(const uint8_t* tile, const Quantized& x, int64_t b0, int64_t b1,
              float (*acc)[kRows]) {
  constexpr bool s8 = BITS == 8 && !kVnni;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int8_t* row[R];  // each row's codes of block 0
  for (int r = 0; r < R; ++r) row[r] = codes(x, r, 0);
  for (int half = 0; half < 2; ++half) {
    __m256 sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm256_loadu_ps(acc[r] + 8 * half);
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* rec = tile + b * record_bytes(BITS);
      if (half == 0) prefetch<BITS>(rec);
      const int8_t* q[R];
      for (int r = 0; r < R; ++r) q[r] = row[r] + b * kCodeStride;
      __m256i dots[R][2];  // row r's q1 and q2 sums, as `accumulate` keeps them
      for (int r = 0; r < R; ++r) dots[r][0] = dots[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {  // unrolled: no branch on c's parity, each load once
        const int chunk = BITS == 4 ? c / 2 : c;
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * chunk + 32 * half));
        const __m256i w = BITS == 4 ? _mm256_and_si256(c % 2 ? _mm256_srli_epi16(v, 4) : v, low)
                                    : v;
        for (int r = 0; r < R; ++r) {
          for (int fine = 0; fine < 2; ++fine) {
            const __m256i qx = _mm256_set1_epi32(load_i32(q[r] + fine * kBlock + 4 * c));
            dots[r][fine] = accumulate<BITS>(dots[r][fine], w, qx);
          }
        }
      }
      const uint8_t* scales = rec + code_bytes(BITS) + 16 * half;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
      __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 32)));
      if (s8) m = _mm256_fmadd_ps(d, _mm256_set1_ps(128.f), m);
      for (int r = 0; r < R; ++r) {
        const __m256 coarse = _mm256_cvtepi32_ps(widen<BITS>(dots[r][0]));
        const __m256 fine = _mm256_cvtepi32_ps(widen<BITS>(dots[r][1]));
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

// Portable: the same arithmetic one weight at a time. The float steps as fused multiply-adds in
// the vector paths' order, which -fassociative-math leaves as they are (it may regroup plain
// sums differently for each R, and a row's bits would then depend on the rows beside it).
template <int BITS, int R>
void tile_dot(const uint8_t* tile, const Quantized& x, int64_t b0, int64_t b1,
              float (*acc)[kRows]) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* rec = tile + b * record_bytes(BITS);
    const c10::Half* scales = reinterpret_cast<const c10::Half*>(rec + code_bytes(BITS));
    for (int64_t row = 0; row < kRows; ++row) {
      for (int r = 0; r < R; ++r) {
        const int8_t* q = codes(x, r, b);
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
        const float dot =
            std::fma(static_cast<float>(fine), 1.f / kFine, static_cast<float>(coarse));
        const int64_t i = r * x.blocks + b;
        const float d = static_cast<float>(scales[row]);
        const float m = static_cast<float>(scales[kRows + row]);
        acc[r][row] = std::fma(dot, d * x.d[i], acc[r][row]);
        acc[r][row] = std::fma(m, x.s[i], acc[r][row]);
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
  // Rows in slices whose codes stay in L2 while a task's tiles pass over them, each tile's
  // weights read once a slice: with all the rows at once, every tile streamed the whole
  // activations from memory. A row's sums are the same whatever slice or group it is in.
  const int64_t slice = std::max(kGroup, kSliceBytes / (x.blocks * 2 * kBlock) / kGroup * kGroup);
  // Within a slice, a tile's blocks in spans that stay in L1 while each group of rows passes
  // over them, the groups' sums kept between spans (the same steps in the same order).
  const int64_t span = rows <= kMaxRows ? x.blocks : kSpanBlocks;
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(slice * kRows);
    for (int64_t s0 = 0; s0 < rows; s0 += slice) {
      const int64_t s1 = std::min(rows, s0 + slice);
      for (int64_t t = begin; t < end; ++t) {
        const uint8_t* tile = packed + t * tile_bytes;
        std::fill(sums.begin(), sums.begin() + (s1 - s0) * kRows, 0.f);
        for (int64_t b0 = 0; b0 < x.blocks; b0 += span) {
          const int64_t b1 = std::min(x.blocks, b0 + span);
          for (int64_t r0 = s0; r0 < s1; r0 += kMaxRows) {
            const Quantized part = from_row(x, r0);
            auto* acc = reinterpret_cast<float(*)[kRows]>(sums.data() + (r0 - s0) * kRows);
            switch (std::min<int64_t>(kMaxRows, s1 - r0)) {
              case 1: tile_dot<BITS, 1>(tile, part, b0, b1, acc); break;
              case 2: tile_dot<BITS, 2>(tile, part, b0, b1, acc); break;
              case 3: tile_dot<BITS, 3>(tile, part, b0, b1, acc); break;
              default: tile_dot<BITS, 4>(tile, part, b0, b1, acc); break;
            }
          }
        }
        const int64_t width = std::min(kRows, n - t * kRows);
        for (int64_t r = s0; r < s1; ++r) {
          T* out = y + r * n + t * kRows;
          const float* sum = sums.data() + (r - s0) * kRows;
          for (int64_t lane = 0; lane < width; ++lane) out[lane] = static_cast<T>(sum[lane]);
        }
      }
    }
  });
}

// The AMX build takes tile products from 5 rows (run_tiles_amx), where the CPU has them and the
// OS lends them; every other call, and every other build, the vector path.
template <int BITS, typename T>
void run(const uint8_t* packed, const Quantized& x, T* y, int64_t rows, int64_t n) {
#if defined(__AMX_INT8__)
  if (rows >= kAmxMinRows && amx_permitted()) return run_tiles_amx<BITS>(packed, x, y, rows, n);
#endif
  run_tiles<BITS>(packed, x, y, rows, n);
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
  const int64_t groups = (rows + kGroup - 1) / kGroup;
  at::Tensor q = at::empty({groups * kGroup * blocks * 2 * kBlock}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({2, rows * blocks}, x.options().dtype(at::kFloat));
  float *d = scales.data_ptr<float>(), *s = d + rows * blocks;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quant_linear", [&] {
    quantize_rows(x.data_ptr<scalar_t>(), rows, k, blocks, q.data_ptr<int8_t>(), d, s);
    const Quantized xq{q.data_ptr<int8_t>(), d, s, blocks, 0};
    const uint8_t* w = packed.data_ptr<uint8_t>();
    if (bits == 4) {
      run<4>(w, xq, y.data_ptr<scalar_t>(), rows, n);
    } else {
      run<8>(w, xq, y.data_ptr<scalar_t>(), rows, n);
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
