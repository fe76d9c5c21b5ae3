// A mixture-of-experts block on the CPU as one op, as decoder_layer.cpp's decoder_mlp is the
// dense MLP: the router, then the step's tokens grouped by expert, each active expert's
// gate_up and down projections run once over the rows that chose it, so a step reads each
// active expert's weights once however many of its tokens chose that expert.
//
// The same bits for a token whatever shares its step: every kernel below computes a row on its
// own. The router's dot products are one routine per (token, expert); an expert's linears are
// tinyllm::linear, whose quantized kernel sums each row alone in a fixed order whatever the row
// count (docs/DESIGN.md, "The same request gives the same bits"); SiLU is per row; each
// token's output sums its own k slots in slot order. Dense experts run torch's GEMM, whose bits
// depend on the row count, as the dense MLP's do.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kTile = 16;   // output rows per tile of QuantLinear's packed records
constexpr int64_t kBlock = 32;  // weights per block of a record
// A packed record's bytes at 4 and 8 bits: 16 rows x 32 codes, then 16 fp16 d and 16 fp16 m.
constexpr int64_t kRecord4 = kTile * kBlock / 2 + 4 * kTile;
constexpr int64_t kRecord8 = kTile * kBlock + 4 * kTile;

// Refuses expert `e`'s weight `name` unless it is what tinyllm::linear takes for n outputs of k
// inputs: a dense (n, k) matrix of x's dtype, or packed records (ceil(n / 16), ceil(k / 32),
// 320 or 576 bytes).
void check_weight(const char* op, const char* name, int64_t e, const at::Tensor& w, int64_t n,
                  int64_t k, at::ScalarType dtype) {
  const std::vector<int64_t> dense{n, k};
  const std::vector<int64_t> tiles{(n + kTile - 1) / kTile, (k + kBlock - 1) / kBlock};
  const bool packed = w.scalar_type() == at::kByte && w.dim() == 3 &&
                      w.sizes().slice(0, 2) == at::IntArrayRef(tiles) &&
                      (w.size(2) == kRecord4 || w.size(2) == kRecord8);
  const bool plain = w.scalar_type() == dtype && w.sizes() == at::IntArrayRef(dense);
  TORCH_CHECK(w.device().is_cpu(), op, ": ", name, "[", e, "] must be on the CPU, not ",
              w.device());
  TORCH_CHECK(packed || plain, op, ": ", name, "[", e, "] ", w.sizes(), " of ", w.scalar_type(),
              " must be ", at::IntArrayRef(dense), " of ", dtype,
              " (x's dtype), or packed records ", at::IntArrayRef(tiles), " x ", kRecord4, " or ",
              kRecord8, " bytes of Byte");
}

// Which slots (t * k + j) chose each expert: the active experts in ascending id, most rows
// first in `by_work`, and their slots in order of slot.
struct Groups {
  std::vector<int64_t> experts;  // the active experts' ids, ascending
  std::vector<int64_t> start;    // experts[i]'s slots are slots[start[i] .. start[i + 1])
  std::vector<int64_t> slots;    // every slot, grouped by expert
  std::vector<int64_t> by_work;  // indices into experts, most rows first
};

Groups group_slots(const int64_t* ids, int64_t slots, int64_t num_experts) {
  std::vector<int64_t> count(num_experts + 1, 0);
  for (int64_t s = 0; s < slots; ++s) ++count[ids[s] + 1];
  Groups g;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (count[e + 1] > 0) {
      g.experts.push_back(e);
      g.start.push_back(count[e]);
    }
    count[e + 1] += count[e];  // now count[e] is expert e's first position
  }
  g.start.push_back(slots);
  g.slots.resize(slots);
  for (int64_t s = 0; s < slots; ++s) g.slots[count[ids[s]]++] = s;
  g.by_work.resize(g.experts.size());
  for (size_t i = 0; i < g.by_work.size(); ++i) g.by_work[i] = static_cast<int64_t>(i);
  std::stable_sort(g.by_work.begin(), g.by_work.end(), [&](int64_t a, int64_t b) {
    return g.start[a + 1] - g.start[a] > g.start[b + 1] - g.start[b];
  });
  return g;
}

// gpt-oss's clamped SwiGLU of h = [gate | up] (rows, 2F) into out (rows, F), in fp32: g =
// min(gate, limit), (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g). Row by row.
void clamped_swiglu(const at::Tensor& out, const at::Tensor& h, double alpha, double limit) {
  const int64_t rows = h.size(0), f = out.size(1);
  const float a = static_cast<float>(alpha), lim = static_cast<float>(limit);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, h.scalar_type(), "clamped_swiglu", [&] {
    const scalar_t* in = h.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < f; ++i) {
        const float g = std::min(static_cast<float>(in[r * 2 * f + i]), lim);
        const float u = std::clamp(static_cast<float>(in[r * 2 * f + f + i]), -lim, lim);
        o[r * f + i] = static_cast<scalar_t>((u + 1.f) * (g / (1.f + std::exp(-a * g))));
      }
    }
  });
}

// out[t] = sum over j of topk_weights[t, j] * expert topk_ids[t, j]'s MLP on x[t], summed in
// fp32 in slot order and rounded once to x's dtype. gate_up[e], down[e]: expert e's weights,
// dense or packed (linear in cpu_ops.h); only the experts some slot chose are read. With
// gate_up_bias (experts, 2F) and down_bias (experts, hidden), row e is expert e's biases; with
// swiglu_limit the activation is clamped_swiglu's (gpt-oss), else SiLU(gate) * up.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights, at::TensorList gate_up, at::TensorList down,
                       int64_t intermediate, const std::optional<at::Tensor>& gate_up_bias,
                       const std::optional<at::Tensor>& down_bias,
                       std::optional<double> swiglu_limit, double swiglu_alpha) {
  const char* op = "moe_experts";
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op,
              ": x must be Float or BFloat16, not ", dtype);
  tinyllm::check_array(op, "x", x, dtype);
  tinyllm::check_array(op, "topk_ids", topk_ids, at::kLong);
  tinyllm::check_array(op, "topk_weights", topk_weights, at::kFloat);
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, op, ": x ", x.sizes(),
              " must be a (tokens, hidden) matrix of at least 1 feature");
  const int64_t n = x.size(0), hidden = x.size(1);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == n, op, ": topk_ids ", topk_ids.sizes(),
              " must be [", n, ", k]: k experts for each of x's rows");
  const int64_t k = topk_ids.size(1);
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), op, ": topk_weights ",
              topk_weights.sizes(), " must be topk_ids' ", topk_ids.sizes());
  const int64_t num_experts = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(num_experts > 0 && down.size() == gate_up.size(), op, ": gate_up and down must ",
              "hold a weight for each expert alike, not ", gate_up.size(), " and ", down.size());
  TORCH_CHECK(intermediate > 0, op, ": intermediate ", intermediate, " must be >= 1");
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  for (int64_t s = 0; s < n * k; ++s) {
    TORCH_CHECK(ids[s] >= 0 && ids[s] < num_experts, op, ": topk_ids[", s / k, ", ", s % k,
                "] = ", ids[s], " is not an expert: there are ", num_experts, " (0 to ",
                num_experts - 1, ")");
  }
  for (const auto* b : {&gate_up_bias, &down_bias}) {
    const int64_t width = b == &gate_up_bias ? 2 * intermediate : hidden;
    TORCH_CHECK(!*b || ((*b)->dim() == 2 && (*b)->size(0) == num_experts &&
                        (*b)->size(1) == width && (*b)->scalar_type() == dtype &&
                        (*b)->is_contiguous()),
                op, ": ", b == &gate_up_bias ? "gate_up_bias " : "down_bias ",
                *b ? (*b)->sizes() : at::IntArrayRef{}, " must be a contiguous [", num_experts,
                ", ", width, "] of x's dtype: a row for each expert");
  }
  const Groups g = group_slots(ids, n * k, num_experts);
  for (const int64_t e : g.experts) {
    check_weight(op, "gate_up", e, gate_up[e], 2 * intermediate, hidden, dtype);
    check_weight(op, "down", e, down[e], hidden, intermediate, dtype);
  }
  at::Tensor out = at::empty({n, hidden}, x.options());
  if (n == 0) return out;
  if (k == 0) return out.zero_();  // no slot: a sum of nothing

  const int64_t active = static_cast<int64_t>(g.experts.size());
  std::vector<at::Tensor> results(active);  // expert experts[i]'s outputs, a row per slot
  at::Tensor gathered = at::empty({n * k, hidden}, x.options());
  const int64_t row_bytes = hidden * static_cast<int64_t>(x.element_size());
  const auto* xs = static_cast<const char*>(x.data_ptr());
  auto* rows = static_cast<char*>(gathered.data_ptr());
  auto run_expert = [&](int64_t i) {
    const int64_t e = g.experts[i], first = g.start[i], count = g.start[i + 1] - first;
    for (int64_t r = first; r < first + count; ++r) {
      std::memcpy(rows + r * row_bytes, xs + g.slots[r] / k * row_bytes, row_bytes);
    }
    const at::Tensor in = gathered.narrow(0, first, count);
    auto bias = [e](const std::optional<at::Tensor>& b) -> std::optional<at::Tensor> {
      return b ? std::optional<at::Tensor>(b->select(0, e)) : std::nullopt;
    };
    const at::Tensor h = tinyllm::linear(in, gate_up[e], bias(gate_up_bias), 2 * intermediate);
    at::Tensor act = at::empty({count, intermediate}, x.options());
    if (swiglu_limit) {
      clamped_swiglu(act, h, swiglu_alpha, *swiglu_limit);
    } else {
      tinyllm::silu_and_mul(act, h);
    }
    results[i] = tinyllm::linear(act, down[e], bias(down_bias), hidden);
  };
  // With at least two experts a thread, each thread runs whole experts, taken most rows first
  // as threads come free: one parallel region a step, where splitting each linear over the
  // threads takes two an expert, and each costs a wait for every thread (docs/MEASUREMENTS.md,
  // "The mixture-of-experts op"). With fewer experts (Mixtral's 2 of 8 at one token), one by
  // one, each linear split over the threads by its output rows.
  const int64_t threads = at::get_num_threads();
  if (active >= 2 * threads && !at::in_parallel_region()) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t i; (i = next.fetch_add(1)) < active;) run_expert(g.by_work[i]);
    });
  } else {
    for (int64_t i = 0; i < active; ++i) run_expert(i);
  }

  // Each slot's output row, then each token's sum over its slots in order.
  std::vector<const void*> slot_row(n * k);
  for (int64_t i = 0; i < active; ++i) {
    const auto* base = static_cast<const char*>(results[i].data_ptr());
    for (int64_t r = g.start[i]; r < g.start[i + 1]; ++r) {
      slot_row[g.slots[r]] = base + (r - g.start[i]) * row_bytes;
    }
  }
  const float* weights = topk_weights.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dtype, "moe_experts", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(hidden);
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < k; ++j) {
          const float w = weights[t * k + j];
          const auto* y = static_cast<const scalar_t*>(slot_row[t * k + j]);
          for (int64_t h = 0; h < hidden; ++h) acc[h] += w * static_cast<float>(y[h]);
        }
        for (int64_t h = 0; h < hidden; ++h) o[t * hidden + h] = static_cast<scalar_t>(acc[h]);
      }
    });
  });
  return out;
}

// sum a[i] b[i] in fp32, in an order that depends on len alone: the router's logit for one
// (token, expert), whatever else the step holds.
template <typename T>
float dot(const T* a, const T* b, int64_t len) {
  constexpr int64_t kLanes = 16;
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      lanes[l] += static_cast<float>(a[i + l]) * static_cast<float>(b[i + l]);
    }
  }
  for (int64_t l = 0; i + l < len; ++l) {
    lanes[l] += static_cast<float>(a[i + l]) * static_cast<float>(b[i + l]);
  }
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

// The router: logits = x gate^T (+ bias) rounded to x's dtype (as an nn.Linear in that dtype
// gives them), softmax over the experts in fp32, the top_k largest (ties: the lower expert id
// first), renormalised to sum 1 when norm_topk_prob; or, softmax_after_topk (gpt-oss), the
// top_k largest logits and the softmax over those. Fills ids and weights, (tokens, top_k).
template <typename T>
void route(const T* x, const T* gate, const T* bias, int64_t n, int64_t hidden,
           int64_t num_experts, int64_t top_k, bool norm_topk_prob, bool softmax_after_topk,
           int64_t* ids, float* weights) {
  std::vector<float> logits(n * num_experts);
  // Experts per task: about 64K multiply-adds, so one token's router is a few tasks.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, n * hidden));
  at::parallel_for(0, num_experts, grain, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      for (int64_t t = 0; t < n; ++t) {
        float logit = dot(x + t * hidden, gate + e * hidden, hidden);
        if (bias) logit += static_cast<float>(bias[e]);
        logits[t * num_experts + e] = static_cast<float>(static_cast<T>(logit));
      }
    }
  });
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<char> taken(num_experts);
    for (int64_t t = begin; t < end; ++t) {
      float* p = logits.data() + t * num_experts;
      const float top = *std::max_element(p, p + num_experts);
      if (!softmax_after_topk) {
        float sum = 0.f;
        for (int64_t e = 0; e < num_experts; ++e) sum += p[e] = std::exp(p[e] - top);
        for (int64_t e = 0; e < num_experts; ++e) p[e] /= sum;
      }
      std::fill(taken.begin(), taken.end(), 0);
      float chosen = 0.f;
      for (int64_t j = 0; j < top_k; ++j) {
        int64_t best = -1;  // the largest untaken probability, NaN above all as torch.topk
        for (int64_t e = 0; e < num_experts; ++e) {
          if (taken[e]) continue;
          if (best < 0 || (std::isnan(p[e]) && !std::isnan(p[best])) || p[e] > p[best]) best = e;
        }
        taken[best] = 1;
        ids[t * top_k + j] = best;
        weights[t * top_k + j] = p[best];
        chosen += p[best];
      }
      if (softmax_after_topk) {  // the chosen logits' softmax: the first is their largest
        float* w = weights + t * top_k;
        const float first = w[0];
        float sum = 0.f;
        for (int64_t j = 0; j < top_k; ++j) sum += w[j] = std::exp(w[j] - first);
        for (int64_t j = 0; j < top_k; ++j) w[j] /= sum;
      } else if (norm_topk_prob) {
        for (int64_t j = 0; j < top_k; ++j) weights[t * top_k + j] /= chosen;
      }
    }
  });
}

// residual += o, then the MoE block on RMSNorm(residual), returned before its residual add
// (tensor parallelism sums it over ranks first). weights: post_attention_layernorm and the
// router's gate (num_experts, hidden), dense in the residual's dtype; gpt-oss's router bias,
// routing and experts' biases and activation as route and moe_experts take them.
at::Tensor decoder_moe(const at::Tensor& o, const at::Tensor& residual, at::TensorList weights,
                       at::TensorList gate_up, at::TensorList down, int64_t top_k,
                       bool norm_topk_prob, int64_t intermediate, double eps,
                       const std::optional<at::Tensor>& router_bias, bool softmax_after_topk,
                       const std::optional<at::Tensor>& gate_up_bias,
                       const std::optional<at::Tensor>& down_bias,
                       std::optional<double> swiglu_limit, double swiglu_alpha) {
  const char* op = "decoder_moe";
  TORCH_CHECK(weights.size() == 2, op, ": 2 weights (post_attention_layernorm, gate), not ",
              weights.size());
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), op, ": residual ",
              residual.sizes(), " must be a contiguous (tokens, hidden) matrix");
  TORCH_CHECK(o.sizes() == residual.sizes(), op, ": o ", o.sizes(), " must be residual's ",
              residual.sizes());
  const auto dtype = residual.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op,
              ": residual must be Float or BFloat16, not ", dtype);
  const at::Tensor &post_norm = weights[0], &gate = weights[1];
  const int64_t n = residual.size(0), hidden = residual.size(1);
  const int64_t num_experts = static_cast<int64_t>(gate_up.size());
  tinyllm::check_array(op, "gate", gate, dtype);
  TORCH_CHECK(gate.dim() == 2 && gate.size(0) == num_experts && gate.size(1) == hidden, op,
              ": gate ", gate.sizes(), " must be [", num_experts, ", ", hidden,
              "]: a row for each of gate_up's experts, of residual's hidden size");
  TORCH_CHECK(top_k >= 1 && top_k <= num_experts, op, ": top_k ", top_k, " must be 1 to ",
              num_experts, ", the number of experts");
  if (router_bias) {
    tinyllm::check_array(op, "router_bias", *router_bias, dtype);
    TORCH_CHECK(router_bias->numel() == num_experts, op, ": router_bias ", router_bias->sizes(),
                " must be [", num_experts, "], one per expert");
  }

  at::Tensor x = at::empty_like(residual);
  tinyllm::rms_norm(x, o, residual, post_norm, eps);  // residual += o, x = its norm
  at::Tensor ids = at::empty({n, top_k}, residual.options().dtype(at::kLong));
  at::Tensor topk_weights = at::empty({n, top_k}, residual.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dtype, "decoder_moe", [&] {
    const scalar_t* bias = router_bias ? router_bias->data_ptr<scalar_t>() : nullptr;
    route(x.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(), bias, n, hidden, num_experts, top_k,
          norm_topk_prob, softmax_after_topk, ids.data_ptr<int64_t>(),
          topk_weights.data_ptr<float>());
  });
  return moe_experts(x, ids, topk_weights, gate_up, down, intermediate, gate_up_bias, down_bias,
                     swiglu_limit, swiglu_alpha);
}

}  // namespace

// decoder_moe's arguments after residual are moe.py's MoEArgs: the same names in the same order.
TORCH_LIBRARY_FRAGMENT(tinyllm, m) {
  m.def(
      "moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor[] gate_up, "
      "Tensor[] down, int intermediate, Tensor? gate_up_bias=None, Tensor? down_bias=None, "
      "float? swiglu_limit=None, float swiglu_alpha=1.702) -> Tensor",
      &moe_experts);
  m.def(
      "decoder_moe(Tensor o, Tensor(a!) residual, Tensor[] weights, Tensor[] gate_up, "
      "Tensor[] down, int top_k, bool norm_topk_prob, int intermediate, float eps, "
      "Tensor? router_bias=None, bool softmax_after_topk=False, Tensor? gate_up_bias=None, "
      "Tensor? down_bias=None, float? swiglu_limit=None, float swiglu_alpha=1.702) -> Tensor",
      &decoder_moe);
}
