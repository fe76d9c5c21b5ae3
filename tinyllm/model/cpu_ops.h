// tinyllm's CPU kernels as C++ functions, for the ops that call each other (decoder_layer.cpp);
// each is also a torch op (torch.ops.tinyllm.*), registered where it is defined.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace tinyllm {

// Refuses, naming the op and the argument, a tensor the kernels cannot read as a plain array of
// `dtype`: one on another device, strided, or of another dtype.
inline void check_array(const char* op, const char* name, const at::Tensor& t,
                        at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on the CPU, not ", t.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " ", t.sizes(),
              " must be contiguous, not of strides ", t.strides());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", not ",
              t.scalar_type());
}

// An int8 K/V cache row (kv_cache_dtype="int8"): a token's head as head_dim int8 codes, then one
// fp32 scale (kScaleBytes) per kGroup of them, the last group possibly shorter. Any other cache's
// row is head_dim values. attention/int8_cache.py has the same layout.
constexpr int64_t kGroup = 32, kScaleBytes = sizeof(float);
inline int64_t int8_groups(int64_t head_dim) { return (head_dim + kGroup - 1) / kGroup; }
inline int64_t int8_row(int64_t head_dim) { return head_dim + kScaleBytes * int8_groups(head_dim); }
// The head_dim of a cache row (row grows strictly with head_dim, so this inverts it).
inline int64_t cache_head_dim(const at::Tensor& cache) {
  const int64_t row = cache.size(-1), per = kGroup + kScaleBytes;
  return cache.scalar_type() == at::kChar ? row - kScaleBytes * ((row + per - 1) / per) : row;
}

// layer_ops.cpp
void rms_norm(const at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& residual,
              const at::Tensor& weight, double eps);
void rotary(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
            const at::Tensor& sin, int64_t heads, int64_t head_dim);
void silu_and_mul(const at::Tensor& out, const at::Tensor& x);
void gelu_tanh_and_mul(const at::Tensor& out, const at::Tensor& x);

// quant_linear.cpp
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t bits);
// y = x W^T (+ bias) for W as the model holds it: QuantLinear's packed records (uint8, 4 or 8
// bits, told apart by their size), or a dense matrix of x's dtype. n: W's output features.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                  int64_t n);

// attention/cpu_kernel.cpp
void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const std::optional<at::Tensor>& k,
                     const std::optional<at::Tensor>& v,
                     const std::optional<at::Tensor>& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, int64_t num_rows, double scale,
                     std::optional<int64_t> window, std::optional<double> softcap = std::nullopt,
                     const std::optional<at::Tensor>& sinks = std::nullopt);

}  // namespace tinyllm
