// A decoder layer's small element-wise steps as one CPU op each, as vLLM's CPU build has them.
//
// In eager torch, RMSNorm is about ten ops, RoPE seven per tensor and SiLU-and-multiply two,
// each a dispatch and a fresh tensor; at one decode row these ops cost as much as the 4-bit
// weights' matrix products. Each op here is one pass over its rows, computing in fp32 and
// rounding once to the tensor's dtype (fp32 or bf16), rows split over torch's threads.
// model/layer_ops.py holds the same steps in torch, for other devices and as the tests' oracle.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "fast_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

template <typename T>
inline float f32(T v) {
  return static_cast<float>(v);
}

// Rows per task: enough work per thread that a one-row decode step stays on one thread.
constexpr int64_t kGrain = 16;

template <typename T>
void rms_norm_impl(T* out, T* residual, const T* x, const T* weight, int64_t rows, int64_t dim,
                   float eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      T* res = residual ? residual + r * dim : nullptr;
      float sum = 0.f;
      for (int64_t i = 0; i < dim; ++i) {
        T h = xr[i];
        if (res) {  // the residual stream, rounded to the dtype as the unfused add rounds it
          h = static_cast<T>(f32(xr[i]) + f32(res[i]));
          res[i] = h;
        }
        sum += f32(h) * f32(h);
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
      const T* h = res ? res : xr;
      T* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i) {
        // Normalised, rounded, then scaled: Hugging Face's order of roundings.
        o[i] = static_cast<T>(f32(weight[i]) * f32(static_cast<T>(f32(h[i]) * inv)));
      }
    }
  });
}

}  // namespace

namespace tinyllm {

// out = RMSNorm(x) * weight; with `residual`, first residual += x (in place), then the norm of
// that sum. x, out: (rows, dim); out may be x.
void rms_norm(const at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& residual,
              const at::Tensor& weight, double eps) {
  const auto dtype = x.scalar_type();
  check_array("rms_norm", "x", x, dtype);
  check_array("rms_norm", "out", out, dtype);
  check_array("rms_norm", "weight", weight, dtype);
  TORCH_CHECK(x.dim() >= 1, "rms_norm: x must have at least 1 dim, not ", x.sizes());
  const int64_t dim = x.size(-1);
  TORCH_CHECK(out.sizes() == x.sizes(), "rms_norm: out ", out.sizes(), " must be x's ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim, "rms_norm: weight ", weight.sizes(),
              " must be [", dim, "], x's last dim");
  if (residual) {
    check_array("rms_norm", "residual", *residual, dtype);
    TORCH_CHECK(residual->sizes() == x.sizes(), "rms_norm: residual ", residual->sizes(),
                " must be x's ", x.sizes());
  }
  if (x.numel() == 0) return;  // no rows, or rows of no features: nothing to normalize
  const int64_t rows = x.numel() / dim;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dtype, "rms_norm", [&] {
    scalar_t* res = residual ? residual->data_ptr<scalar_t>() : nullptr;
    rms_norm_impl<scalar_t>(out.data_ptr<scalar_t>(), res, x.data_ptr<scalar_t>(),
                            weight.data_ptr<scalar_t>(), rows, dim, static_cast<float>(eps));
  });
}

// Rotary embedding in place on the first `heads` heads of each token's row of `qkv` (N, width),
// Hugging Face's rotate-half layout over each head's first R dims: x[i] pairs with x[i + R/2].
// cos, sin: (positions, R/2); R is the head's D but for partial rotary (Phi-4-mini: 96 of 128).
void rotary(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
            const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(qkv.device().is_cpu(), "rotary: qkv must be on the CPU, not ", qkv.device());
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rotary: qkv ", qkv.sizes(), " of strides ",
              qkv.strides(), " must be a (tokens, width) matrix of contiguous rows");
  check_array("rotary", "positions", positions, at::kLong);
  check_array("rotary", "cos", cos, at::kFloat);
  check_array("rotary", "sin", sin, at::kFloat);
  const int64_t n = qkv.size(0), stride = qkv.stride(0), half = cos.dim() == 2 ? cos.size(1) : 0;
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == n, "rotary: positions ",
              positions.sizes(), " must be [", n, "], one per row of qkv");
  TORCH_CHECK(head_dim >= 0 && head_dim % 2 == 0, "rotary: head_dim must be even, not ",
              head_dim);
  TORCH_CHECK(heads >= 0 && heads * head_dim <= qkv.size(1), "rotary: ", heads, " heads of ",
              head_dim, " do not fit in qkv's rows of ", qkv.size(1));
  TORCH_CHECK(cos.dim() == 2 && 2 * half <= head_dim && sin.sizes() == cos.sizes(), "rotary: cos ",
              cos.sizes(), " and sin ", sin.sizes(), " must both be [positions, at most ",
              head_dim / 2, "]: one frequency per pair of rotated dims");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary: position ", pos[t],
                " outside the table's ", cos.size(0));
  }
  const float *cs = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rotary", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cs + pos[t] * half;
        const float* s = sn + pos[t] * half;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* x = base + t * stride + h * head_dim;
          for (int64_t i = 0; i < half; ++i) {
            const float a = f32(x[i]), b = f32(x[i + half]);
            x[i] = static_cast<scalar_t>(a * c[i] - b * s[i]);
            x[i + half] = static_cast<scalar_t>(b * c[i] + a * s[i]);
          }
        }
      }
    });
  });
}

namespace {

// Checks out (N, F) against x (N, 2F), the gate and up projections side by side, for `op`.
void check_gated(const char* op, const at::Tensor& out, const at::Tensor& x) {
  check_array(op, "x", x, x.scalar_type());
  check_array(op, "out", out, x.scalar_type());
  TORCH_CHECK(out.dim() >= 1, op, ": out must have at least 1 dim, not ", out.sizes());
  std::vector<int64_t> gate_up = out.sizes().vec();
  gate_up.back() *= 2;
  TORCH_CHECK(x.sizes() == at::IntArrayRef(gate_up), op, ": x ", x.sizes(), " must be ",
              at::IntArrayRef(gate_up), ": out's rows, twice as wide");
}

}  // namespace

// out (N, F) = silu(x[:, :F]) * x[:, F:] for x (N, 2F): the gate and up projections, fused.
void silu_and_mul(const at::Tensor& out, const at::Tensor& x) {
  check_gated("silu_and_mul", out, x);
  if (out.numel() == 0) return;  // no rows, or rows of no features
  const int64_t f = out.size(-1), rows = out.numel() / f;
  // exp(-gate) a chunk at a time, then the quotients, in two loops: in one, GCC also computes
  // the quotient of fast_exp's clamped case (a / (1 + e^88)) in every lane and blends it in,
  // and for most gates that is a denormal, a microcode assist each: many times slower.
  constexpr int64_t kChunk = 256;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
      float e[kChunk];
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i0 = 0; i0 < f; i0 += kChunk) {
          const int64_t n = std::min(kChunk, f - i0);
          const scalar_t *g = in + r * 2 * f + i0, *u = g + f;
          for (int64_t i = 0; i < n; ++i) e[i] = tinyllm::fast_exp(-f32(g[i]));
          for (int64_t i = 0; i < n; ++i) {
            // Rounded after the SiLU as torch's two ops round: the same numbers in bf16.
            o[r * f + i0 + i] = static_cast<scalar_t>(
                f32(static_cast<scalar_t>(f32(g[i]) / (1.f + e[i]))) * f32(u[i]));
          }
        }
      }
    });
  });
}

// out (N, F) = gelu_tanh(x[:, :F]) * x[:, F:] for x (N, 2F): Gemma's GeGLU, with GELU's tanh
// approximation 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), as torch's
// gelu(approximate="tanh") computes it; rounded after the GELU as torch's two ops round.
void gelu_tanh_and_mul(const at::Tensor& out, const at::Tensor& x) {
  check_gated("gelu_tanh_and_mul", out, x);
  if (out.numel() == 0) return;
  const int64_t f = out.size(-1), rows = out.numel() / f;
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;  // sqrt(2 / pi)
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "gelu_tanh_and_mul", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t *g = in + r * 2 * f, *u = g + f;
        for (int64_t i = 0; i < f; ++i) {
          const float a = f32(g[i]);
          const float gelu = 0.5f * a * (1.f + std::tanh(kBeta * (a + kKappa * a * a * a)));
          o[r * f + i] = static_cast<scalar_t>(f32(static_cast<scalar_t>(gelu)) * f32(u[i]));
        }
      }
    });
  });
}

}  // namespace tinyllm

TORCH_LIBRARY_FRAGMENT(tinyllm, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor(b!)? residual, Tensor weight, float eps) -> ()",
        &tinyllm::rms_norm);
  m.def("rotary(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int heads, int head_dim) "
        "-> ()",
        &tinyllm::rotary);
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()", &tinyllm::silu_and_mul);
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor x) -> ()", &tinyllm::gelu_tanh_and_mul);
}
