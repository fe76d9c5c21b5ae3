// A decoder layer on the CPU as two ops, its attention and its MLP: the same steps as llama.py's
// DecoderLayer, from the same kernels, without going back to Python between them.
//
// At one decode row of a small model, a step's time is mostly not arithmetic: each of a layer's
// ten or so ops costs a Python module call, a trip through torch's dispatcher and a fresh
// tensor (docs/MEASUREMENTS.md, "The decoder layer as C++ ops").
//
// The layer is split where tensor parallelism all-reduces: each op returns its last
// projection's output (o_proj's, down_proj's) before it is added to the residual stream, so a
// sum over ranks fits between them. Each add is then done by the next op, fused into its norm
// as the modules' path fuses it: residual += the sublayer's output, rounded to the dtype as the
// unfused add rounds it, in place. Gemma normalizes a sublayer's output before that add (its
// post-attention and post-feedforward norms): after the all-reduce, so in the next op too.
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

// The residual stream, and the last sublayer's output to add into it (when there is one).
void check_residual(const char* op, const at::Tensor& residual, const char* name,
                    const std::optional<at::Tensor>& add) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), op, ": residual ",
              residual.sizes(), " must be a contiguous (tokens, hidden) matrix");
  TORCH_CHECK(!add || add->sizes() == residual.sizes(), op, ": ", name, " ", add->sizes(),
              " must be residual's ", residual.sizes());
}

// residual += hidden (when given; the first layer has nothing to add; with hidden_norm, the
// RMSNorm of hidden by it: the previous layer's post-feedforward norm), then o_proj(attention(
// RMSNorm(residual))), returned; softcap: the kernel's soft-capping of scores (Gemma 2); sinks:
// its per-head softmax sinks, o_bias o_proj's bias (gpt-oss).
// weights: input_layernorm, qkv_proj, o_proj; a projection is a dense weight or QuantLinear's
// packed records (cpu_ops.h linear). The K/V cache, the step's
// metadata and the layer's sliding window (None: none) are what attention/cpu.py passes the same
// kernel. The step's arguments come first, the layer's own (weights, sizes) last: the model
// gathers those once.
at::Tensor decoder_attention(const std::optional<at::Tensor>& hidden, const at::Tensor& residual,
                             const at::Tensor& positions, const at::Tensor& cos,
                             const at::Tensor& sin, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t num_rows,
                             at::TensorList weights, const std::optional<at::Tensor>& qkv_bias,
                             const std::optional<at::Tensor>& q_norm,
                             const std::optional<at::Tensor>& k_norm, int64_t heads,
                             int64_t kv_heads, double eps, double scale,
                             std::optional<int64_t> window,
                             const std::optional<at::Tensor>& hidden_norm,
                             std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
                             const std::optional<at::Tensor>& o_bias) {
  TORCH_CHECK(weights.size() == 3, "decoder_attention: 3 weights, not ", weights.size());
  check_residual("decoder_attention", residual, "hidden", hidden);
  TORCH_CHECK(k_cache.dim() == 4, "decoder_attention: k_cache ", k_cache.sizes(),
              " must be (blocks, block_size, kv_heads, head_dim)");
  TORCH_CHECK(heads > 0 && kv_heads > 0, "decoder_attention: heads ", heads, " and kv_heads ",
              kv_heads, " must be >= 1");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(),
              "decoder_attention: q_norm and k_norm together");
  const at::Tensor &input_norm = weights[0], &qkv_w = weights[1], &o_w = weights[2];
  // The ops below check the rest: each weight against its input, the K/V heads against the
  // caches, the step's metadata against q's tokens. A step of no tokens does no work in them.
  const int64_t n = residual.size(0), hidden_size = residual.size(1), dim = tinyllm::cache_head_dim(k_cache);

  at::Tensor x = at::empty_like(residual);
  if (hidden && hidden_norm) {
    tinyllm::rms_norm(x, *hidden, std::nullopt, *hidden_norm, eps);
    tinyllm::rms_norm(x, x, residual, input_norm, eps);  // residual += normed hidden, x = norm
  } else if (hidden) {
    tinyllm::rms_norm(x, *hidden, residual, input_norm, eps);  // residual += hidden, x = its norm
  } else {
    tinyllm::rms_norm(x, residual, std::nullopt, input_norm, eps);
  }
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
                           query_start_loc, num_rows, scale, window, softcap, sinks);
  return tinyllm::linear(attn.view({n, heads * dim}), o_w, o_bias, hidden_size);
}

// residual += o (with o_norm, the RMSNorm of o by it: Gemma's post-attention norm), then
// down_proj(act_and_mul(gate_up_proj(RMSNorm(residual)))), returned, act: "silu" (SwiGLU) or
// "gelu_tanh" (GeGLU). weights: the pre-MLP norm (post_attention_layernorm, Gemma's
// pre_feedforward_layernorm), gate_up_proj, down_proj.
at::Tensor decoder_mlp(const at::Tensor& o, const at::Tensor& residual, at::TensorList weights,
                       int64_t intermediate, double eps, const std::optional<at::Tensor>& o_norm,
                       c10::string_view activation) {
  TORCH_CHECK(weights.size() == 3, "decoder_mlp: 3 weights, not ", weights.size());
  check_residual("decoder_mlp", residual, "o", o);
  TORCH_CHECK(intermediate > 0, "decoder_mlp: intermediate ", intermediate, " must be >= 1");
  const bool gelu = activation == "gelu_tanh";
  TORCH_CHECK(gelu || activation == "silu", "decoder_mlp: activation '", activation,
              "' must be 'silu' or 'gelu_tanh'");
  const at::Tensor &post_norm = weights[0], &gate_up_w = weights[1], &down_w = weights[2];
  const int64_t n = residual.size(0), hidden_size = residual.size(1);

  at::Tensor x = at::empty_like(residual);
  if (o_norm) {
    tinyllm::rms_norm(x, o, std::nullopt, *o_norm, eps);
    tinyllm::rms_norm(x, x, residual, post_norm, eps);  // residual += normed o, x = its norm
  } else {
    tinyllm::rms_norm(x, o, residual, post_norm, eps);  // residual += o, x = its norm
  }
  at::Tensor gate_up = tinyllm::linear(x, gate_up_w, std::nullopt, 2 * intermediate);
  at::Tensor act = at::empty({n, intermediate}, residual.options());
  if (gelu) {
    tinyllm::gelu_tanh_and_mul(act, gate_up);
  } else {
    tinyllm::silu_and_mul(act, gate_up);
  }
  return tinyllm::linear(act, down_w, std::nullopt, hidden_size);
}

}  // namespace

// The layer's own arguments, weights onwards, are llama.py's AttentionArgs and MLPArgs: the same
// names in the same order (tests/test_fused_op_args.py checks).
TORCH_LIBRARY_FRAGMENT(tinyllm, m) {
  m.def(
      "decoder_attention(Tensor? hidden, Tensor(a!) residual, Tensor positions, Tensor cos, "
      "Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int num_rows, "
      "Tensor[] weights, Tensor? qkv_bias, Tensor? q_norm, Tensor? k_norm, int heads, "
      "int kv_heads, float eps, float scale, int? window, Tensor? hidden_norm=None, "
      "float? softcap=None, Tensor? sinks=None, Tensor? o_bias=None) -> Tensor",
      &decoder_attention);
  m.def(
      "decoder_mlp(Tensor o, Tensor(a!) residual, Tensor[] weights, int intermediate, float eps, "
      "Tensor? o_norm=None, str activation=\"silu\") -> Tensor",
      &decoder_mlp);
}
