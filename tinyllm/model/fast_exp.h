// exp(x) as a branch-free function, so that a loop of it vectorizes (std::exp does not, without
// -ffast-math): 2^n * e^r with r in [-ln2/2, ln2/2] and Cephes' polynomial for e^r (about 1
// ulp). Shared by the attention kernel (softmax) and layer_ops.cpp (SiLU).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tinyllm {

// x is clamped to [-87, 88]: below, -inf included, it returns ~1e-38, not 0 (where an exact 0
// matters, as for masked keys, callers set it); above, 1.65e38 rather than inf.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
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

}  // namespace tinyllm
