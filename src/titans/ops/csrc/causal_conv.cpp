// The causal depthwise conv + SiLU of titans.ops.conv, fused into one pass per direction for CPU.
//
// x: (B, T, C) rows, tail: (B, K - 1, C) the rows before them, wt: (K, C) the taps (weight transposed),
// bias: (C) or none. Output row t = silu(bias + sum_j wt[j] * padded[t + j]) over padded = [tail; x].
// The output is (B, T, C), or with P > 0 the (P, B, H, T, C / (P H)) q/k/v heads layout.
// Built on first use by titans/ops/conv.py (torch.utils.cpp_extension); tested against F.conv1d.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "activations.h"

namespace {

using titans::safe_sigmoid;
using titans::silu_grad;

// Offset of element (b, t, c0) in the output: plain (B, T, C), or split (P, B, H, T, d) with channel
// groups of d contiguous channels (group g = p * H + h).
struct Layout {
  int64_t B, T, C, P, H, d;
  bool split;
  inline int64_t group_offset(int64_t b, int64_t t, int64_t g) const {
    if (!split) return (b * T + t) * C + g * d;
    const int64_t p = g / H, h = g % H;
    return (((p * B + b) * H + h) * T + t) * d;
  }
};

template <typename scalar_t>
inline const scalar_t* padded_row(const scalar_t* x, const scalar_t* tail, int64_t b, int64_t r,
                                  int64_t T, int64_t Km1, int64_t C) {
  return r < Km1 ? tail + (b * Km1 + r) * C : x + (b * T + (r - Km1)) * C;
}

template <typename scalar_t, typename acc_t>
void pre_activation(const scalar_t* x, const scalar_t* tail, const scalar_t* wt, const scalar_t* bias,
                    int64_t b, int64_t t, int64_t T, int64_t K, int64_t C, acc_t* pre) {
  for (int64_t c = 0; c < C; ++c) pre[c] = bias ? static_cast<acc_t>(bias[c]) : acc_t(0);
  for (int64_t j = 0; j < K; ++j) {
    const scalar_t* row = padded_row(x, tail, b, t + j, T, K - 1, C);
    const scalar_t* w = wt + j * C;
    for (int64_t c = 0; c < C; ++c) pre[c] += static_cast<acc_t>(w[c]) * static_cast<acc_t>(row[c]);
  }
}

}  // namespace

torch::Tensor forward(torch::Tensor x, torch::Tensor tail, torch::Tensor wt, c10::optional<torch::Tensor> bias,
                      int64_t P, int64_t H) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), K = wt.size(0);
  const bool split = P > 0;
  Layout lay{B, T, C, split ? P : 1, split ? H : 1, split ? C / (P * H) : C, split};
  auto out = split ? torch::empty({P, B, H, T, lay.d}, x.options()) : torch::empty({B, T, C}, x.options());
  const int64_t groups = split ? P * H : 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "causal_conv_silu_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* tp = tail.data_ptr<scalar_t>();
    const scalar_t* wp = wt.data_ptr<scalar_t>();
    const scalar_t* bp = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, B * T, 16, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> pre(C);
      for (int64_t bt = begin; bt < end; ++bt) {
        const int64_t b = bt / T, t = bt % T;
        pre_activation(xp, tp, wp, bp, b, t, T, K, C, pre.data());
        for (int64_t g = 0; g < groups; ++g) {
          scalar_t* dst = op + lay.group_offset(b, t, g);
          const acc_t* src = pre.data() + g * lay.d;
          for (int64_t i = 0; i < lay.d; ++i) dst[i] = static_cast<scalar_t>(src[i] * safe_sigmoid(src[i]));
        }
      }
    });
  });
  return out;
}

// Gradients from g (the output's, in the output's layout): g_x (B, T, C), g_tail (B, K - 1, C), and
// g_wt (K, C), g_bias (C) in the accumulation dtype. Tasks own blocks of padded rows: each recomputes the
// pre-activation and g * silu' for its rows (and the K - 1 before them, which its first rows gather from),
// gathers its rows' input gradient, and adds its own rows' terms to the tap and bias sums.
std::vector<torch::Tensor> backward(torch::Tensor x, torch::Tensor tail, torch::Tensor wt,
                                    c10::optional<torch::Tensor> bias, torch::Tensor g, int64_t P, int64_t H,
                                    int64_t rows_per_task) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), K = wt.size(0), Km1 = K - 1;
  const bool split = P > 0;
  Layout lay{B, T, C, split ? P : 1, split ? H : 1, split ? C / (P * H) : C, split};
  const int64_t groups = split ? P * H : 1;
  const int64_t rows = T + Km1;  // padded rows: the tail's, then x's
  const int64_t blocks = (rows + rows_per_task - 1) / rows_per_task;
  auto g_x = torch::empty({B, T, C}, x.options());
  auto g_tail = torch::empty({B, Km1, C}, x.options());
  const auto acc_dtype = at::toOpMathType(x.scalar_type());
  auto g_wt = torch::zeros({K, C}, x.options().dtype(acc_dtype));
  auto g_b = torch::zeros({C}, x.options().dtype(acc_dtype));
  std::mutex lock;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "causal_conv_silu_bwd", [&] {
    // each range of tasks' tap and bias sums (K * C, then C), keyed by the range's first task: added in that
    // order after the loop, so a run's gradients do not depend on which thread finished first
    std::vector<std::pair<int64_t, std::vector<at::opmath_type<scalar_t>>>> partials;
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* tp = tail.data_ptr<scalar_t>();
    const scalar_t* wp = wt.data_ptr<scalar_t>();
    const scalar_t* bp = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    const scalar_t* gp_in = g.data_ptr<scalar_t>();
    scalar_t* gxp = g_x.data_ptr<scalar_t>();
    scalar_t* gtp = g_tail.data_ptr<scalar_t>();
    acc_t* gwp = g_wt.data_ptr<acc_t>();
    acc_t* gbp = g_b.data_ptr<acc_t>();
    at::parallel_for(0, B * blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> ring(K * C), pre(C), gw(K * C, acc_t(0)), gb(C, acc_t(0)), gx(C);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / blocks, p0 = (task % blocks) * rows_per_task;
        const int64_t p1 = std::min(rows, p0 + rows_per_task);
        // gp rows t are computed in order up to what padded row p needs (t <= p); those before p0 only
        // feed the first rows' input gradient (the task that owns them counts them in the weight sums)
        int64_t next_t = std::max<int64_t>(0, p0 - Km1);
        for (int64_t p = p0; p < p1; ++p) {
          for (; next_t <= std::min(p, T - 1); ++next_t) {
            const int64_t t = next_t;
            pre_activation(xp, tp, wp, bp, b, t, T, K, C, pre.data());
            acc_t* gp = ring.data() + (t % K) * C;
            for (int64_t grp = 0; grp < groups; ++grp) {
              const scalar_t* gsrc = gp_in + lay.group_offset(b, t, grp);
              const int64_t c0 = grp * lay.d;
              for (int64_t i = 0; i < lay.d; ++i) {
                gp[c0 + i] = static_cast<acc_t>(gsrc[i]) * silu_grad(pre[c0 + i]);
              }
            }
            if (t >= p0) {
              for (int64_t c = 0; c < C; ++c) gb[c] += gp[c];
              for (int64_t j = 0; j < K; ++j) {
                const scalar_t* row = padded_row(xp, tp, b, t + j, T, Km1, C);
                acc_t* w = gw.data() + j * C;
                for (int64_t c = 0; c < C; ++c) w[c] += gp[c] * static_cast<acc_t>(row[c]);
              }
            }
          }
          // padded row p gathers gp[p - j] w_j over the output rows 0 <= p - j < T
          std::fill(gx.begin(), gx.end(), acc_t(0));
          for (int64_t j = 0; j < K; ++j) {
            const int64_t t = p - j;
            if (t < 0 || t >= T) continue;
            const acc_t* gp = ring.data() + (t % K) * C;
            const scalar_t* w = wp + j * C;
            for (int64_t c = 0; c < C; ++c) gx[c] += gp[c] * static_cast<acc_t>(w[c]);
          }
          scalar_t* dst = p < Km1 ? gtp + (b * Km1 + p) * C : gxp + (b * T + p - Km1) * C;
          for (int64_t c = 0; c < C; ++c) dst[c] = static_cast<scalar_t>(gx[c]);
        }
      }
      gw.insert(gw.end(), gb.begin(), gb.end());
      std::lock_guard<std::mutex> guard(lock);
      partials.emplace_back(begin, std::move(gw));
    });
    std::sort(partials.begin(), partials.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& part : partials) {
      const acc_t* sums = part.second.data();
      for (int64_t i = 0; i < K * C; ++i) gwp[i] += sums[i];
      for (int64_t c = 0; c < C; ++c) gbp[c] += sums[K * C + c];
    }
  });
  return {g_x, g_tail, g_wt, g_b};
}
