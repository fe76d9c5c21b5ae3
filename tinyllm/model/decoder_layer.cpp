// A whole decoder layer on the CPU as one op: the same steps as llama.py's DecoderLayer, from the
// same kernels, without going back to Python between them.
//
// At one decode row of a small model, a step's time is mostly not arithmetic: each of a layer's
// ten or so ops costs a Python module call, a trip through torch's dispatcher and a fresh
// tensor, about 5 us each: for the default model's 30 layers in 4 bits, 2 of the 5.3 ms that
// the forward pass took.
//
// The residual stream is updated in place: residual += attention(RMSNorm(residual)), then
// residual += MLP(RMSNorm(residual)), each sum rounded to the dtype as the unfused add rounds it.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <optional>

namespace {

// RMSNorm of each of a token's heads (Qwen3's q_norm and k_norm) in `heads`, a strided view.
void norm_heads(const at::Tensor& heads, const at::Tensor& weight, double eps) {
  at::Tensor h = heads.contiguous();
  tinyllm::rms_norm(h, h, std::nullopt, weight, eps);
  heads.copy_(h);
}

// weights: input_layernorm, qkv_proj, o_proj, post_attention_layernorm, gate_up_proj,
// down_proj; a projection is a dense weight or QuantLinear's packed records (cpu_ops.h linear).
// The K/V cache and the step's metadata are what attention/cpu.py passes the same kernel.
void decoder_layer(const at::Tensor& residual, const at::Tensor& positions, const at::Tensor& cos,
                   const at::Tensor& sin, at::TensorList weights,
                   const std::optional<at::Tensor>& qkv_bias,
                   const std::optional<at::Tensor>& q_norm,
                   const std::optional<at::Tensor>& k_norm, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const at::Tensor& query_start_loc, int64_t num_rows, int64_t heads,
                   int64_t kv_heads, int64_t intermediate, double eps, double scale) {
  TORCH_CHECK(weights.size() == 6, "decoder_layer: 6 weights, not ", weights.size());
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "decoder_layer: residual ",
              residual.sizes(), " must be a contiguous (tokens, hidden) matrix");
  TORCH_CHECK(k_cache.dim() == 4, "decoder_layer: k_cache ", k_cache.sizes(),
              " must be (blocks, block_size, kv_heads, head_dim)");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && intermediate > 0, "decoder_layer: heads ", heads,
              ", kv_heads ", kv_heads, " and intermediate ", intermediate, " must be >= 1");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decoder_layer: q_norm and k_norm together");
  const at::Tensor &input_norm = weights[0], &qkv_w = weights[1], &o_w = weights[2];
  const at::Tensor &post_norm = weights[3], &gate_up_w = weights[4], &down_w = weights[5];
  // The ops below check the rest: each weight against its input, the K/V heads against the
  // caches, the step's metadata against q's tokens. A step of no tokens does no work in them.
  const int64_t n = residual.size(0), hidden = residual.size(1), dim = k_cache.size(3);

  at::Tensor x = at::empty_like(residual);
  tinyllm::rms_norm(x, residual, std::nullopt, input_norm, eps);
  at::Tensor qkv = tinyllm::linear(x, qkv_w, qkv_bias, (heads + 2 * kv_heads) * dim);
  at::Tensor split = qkv.view({n, heads + 2 * kv_heads, dim});
  at::Tensor q = split.narrow(1, 0, heads), k = split.narrow(1, heads, kv_heads);
  at::Tensor v = split.narrow(1, heads + kv_heads, kv_heads);
  if (q_norm) {  // Qwen3: per head, before the rotation
    norm_heads(q, *q_norm, eps);
    norm_heads(k, *k_norm, eps);
  }
  tinyllm::rotary(qkv, positions, cos, sin, heads + kv_heads, dim);
  at::Tensor attn = at::empty({n, heads, dim}, residual.options());
  tinyllm::paged_attention(attn, q, k_cache, v_cache, k, v, slot_mapping, block_tables, seq_lens,
                           query_start_loc, num_rows, scale);
  at::Tensor o = tinyllm::linear(attn.view({n, heads * dim}), o_w, std::nullopt, hidden);

  tinyllm::rms_norm(x, o, residual, post_norm, eps);  // residual += o, x = its norm
  at::Tensor gate_up = tinyllm::linear(x, gate_up_w, std::nullopt, 2 * intermediate);
  at::Tensor act = at::empty({n, intermediate}, residual.options());
  tinyllm::silu_and_mul(act, gate_up);
  residual.add_(tinyllm::linear(act, down_w, std::nullopt, hidden));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tinyllm, m) {
  m.def(
      "decoder_layer(Tensor(a!) residual, Tensor positions, Tensor cos, Tensor sin, "
      "Tensor[] weights, Tensor? qkv_bias, Tensor? q_norm, Tensor? k_norm, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, int num_rows, int heads, int kv_heads, int intermediate, "
      "float eps, float scale) -> ()",
      &decoder_layer);
}
