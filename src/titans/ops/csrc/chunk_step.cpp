// The memory's chunk step without autograd (titans/ops/memory/chunk.py, `_chunk_forward`, the "titans"
// rule's l2 inner loss, memory depth 1 or 2): the reads of a chunk's queries and its keys' inner gradients
// at the chunk-start weights, the surprise norms, the clip and the write X' = mix @ X + U per layer.
//
// The matmuls are ATen's (bmm); what lies between them (activation, residual, error, act', the norms, the
// clip and the gates' scaling of the write's inputs) is one loop per stage over each sequence's rows. The
// torch-op step runs 35 small computing operators a chunk, and at batch 1 their per-call cost, not their
// arithmetic, is most of its time.
//
// kq: (N, 2n, d) the chunk's keys then its queries; v: (N, n, d); gamma, beta: (N, n); mix: (N, 2, 2);
// states, outs: per layer (N, 2, d_in, d_out), outs contiguous and not overlapping states; anchors: none,
// or per layer (N, d_in, d_out), what forgetting pulls W toward (W' += (1 - A_b) W_anchor, A_b = mix[0, 0]).
// Writes each layer's new state into outs and returns y (N, n, d) and the surprise norms (N, n).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "activations.h"

void state_mix_forward(torch::Tensor x, torch::Tensor mix, torch::Tensor out);

namespace {

enum Activation : int64_t { kSilu = 0, kGelu = 1, kRelu = 2 };

// NaN by its bits: -ffast-math lets the compiler assume no NaN, fold std::isnan to false and turn a
// comparison into a max/min instruction that returns a number for NaN; a test of the bits it must keep.
// Arithmetic still carries NaN and inf through; the clamps and branches below test for NaN first, so a
// non-finite key, value or query comes out where the torch ops put it (nothing made finite).
inline bool is_nan(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return (b & 0x7fffffffu) > 0x7f800000u;
}
inline bool is_nan(double x) {
  uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return (b & 0x7fffffffffffffffull) > 0x7ff0000000000000ull;
}

template <typename T>
inline T act(T x, int64_t a) {
  if (a == kSilu) return x * titans::safe_sigmoid(x);
  if (a == kGelu) return T(0.5) * x * (T(1) + std::erf(x * T(M_SQRT1_2)));
  return (is_nan(x) || !(x < T(0))) ? x : T(0);  // NaN stays NaN, as torch's relu leaves it
}

// act'(x)
template <typename T>
inline T act_grad(T x, int64_t a) {
  if (a == kSilu) return titans::silu_grad(x);
  if (a == kGelu) {
    return T(0.5) * (T(1) + std::erf(x * T(M_SQRT1_2))) + x * T(0.3989422804014327) * std::exp(T(-0.5) * x * x);
  }
  return (is_nan(x) || !(x <= T(0))) ? T(1) : T(0);  // torch's threshold_backward: g where not x <= 0
}

// rows of a (N, r, c) tensor dense per sequence (the batch stride free): a chunk's view of a longer tensor
torch::Tensor dense_rows(const torch::Tensor& t) {
  return (t.stride(2) == 1 && t.stride(1) == t.size(2)) ? t : t.contiguous();
}

// per sequence, in parallel where there is enough work to share
template <typename F>
void per_sequence(int64_t n_seq, int64_t work, const F& f) {
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, work));
  at::parallel_for(0, n_seq, grain, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) f(s);
  });
}

}  // namespace

std::vector<torch::Tensor> chunk_step_forward(torch::Tensor kq, torch::Tensor v, torch::Tensor gamma,
                                              torch::Tensor beta, torch::Tensor mix, std::vector<torch::Tensor> states,
                                              std::vector<torch::Tensor> outs, std::vector<torch::Tensor> anchors,
                                              int64_t activation, bool residual, double clip, double threshold) {
  // clip, threshold: < 0 for none
  const int64_t depth = static_cast<int64_t>(states.size());
  TORCH_CHECK(depth == 1 || depth == 2, "chunk_step_forward: memory depth 1 or 2, got ", depth);
  TORCH_CHECK(outs.size() == states.size(), "chunk_step_forward: one out per state");
  TORCH_CHECK(anchors.empty() || anchors.size() == states.size(), "chunk_step_forward: one anchor per state");
  kq = dense_rows(kq);
  v = dense_rows(v);
  gamma = gamma.contiguous();
  beta = beta.contiguous();
  mix = mix.contiguous();
  const int64_t N = kq.size(0), n = v.size(1), d = kq.size(2);
  // the loops index these by their shapes: a mismatch is refused here, never read past an end
  TORCH_CHECK(kq.dim() == 3 && v.dim() == 3 && v.size(0) == N && v.size(2) == d && kq.size(1) == 2 * n,
              "chunk_step_forward: kq (N, 2n, d) holds the chunk's keys then its queries, v (N, n, d)");
  TORCH_CHECK(gamma.numel() == N * n && beta.numel() == N * n && mix.numel() == N * 4,
              "chunk_step_forward: gamma, beta (N, n) and mix (N, 2, 2)");
  const auto opts = kq.options();
  std::vector<torch::Tensor> ws;
  for (int64_t l = 0; l < depth; ++l) {
    const auto& x = states[l];
    TORCH_CHECK(x.dim() == 4 && x.size(0) == N && x.size(1) == 2 && outs[l].sizes() == x.sizes() &&
                    x.size(2) == (l == 0 ? d : states[l - 1].size(3)) && (l < depth - 1 || x.size(3) == d),
                "chunk_step_forward: states and outs per layer (N, 2, d_in, d_out), from d back to d");
    TORCH_CHECK(outs[l].is_contiguous(), "chunk_step_forward: outs must be contiguous");
    TORCH_CHECK(anchors.empty() || anchors[l].numel() == N * x.size(2) * x.size(3),
                "chunk_step_forward: anchors per layer (N, d_in, d_out)");
    ws.push_back(x.select(1, 0));  // W_l (N, d_in, d_out)
  }
  const int64_t h = ws[0].size(2);  // layer 1's output width (d for depth 1)

  // the MLP on keys and queries: z = kq W_1 (hidden pre-activation for depth 2), a = act(z), o = a W_2
  torch::Tensor z = at::bmm(kq, ws[0]);
  torch::Tensor a1, o;
  if (depth == 2) {
    a1 = at::empty_like(z);
    o = at::empty({N, 2 * n, d}, opts);
  }
  torch::Tensor y = at::empty({N, n, d}, opts);
  torch::Tensor delta_out = at::empty({N, n, d}, opts);
  torch::Tensor norm = at::empty({N, n}, opts);
  // the layers' write inputs scaled by the gates: (N, n, 2 d_in) = [c_W a | c_S a] per token
  std::vector<torch::Tensor> scaled;
  scaled.push_back(at::empty({N, n, 2 * d}, opts));
  if (depth == 2) scaled.push_back(at::empty({N, n, 2 * h}, opts));
  torch::Tensor delta_hid;

  AT_DISPATCH_FLOATING_TYPES(kq.scalar_type(), "chunk_step_forward", [&] {
    using T = scalar_t;
    if (depth == 2) {
      const T* zp = z.data_ptr<T>();
      T* ap = a1.data_ptr<T>();
      per_sequence(N, 2 * n * h, [&](int64_t s) {
        for (int64_t i = s * 2 * n * h, e = i + 2 * n * h; i < e; ++i) ap[i] = act(zp[i], activation);
      });
      at::bmm_out(o, a1, ws[1]);
    } else {
      o = z;
    }
    // y = o (+ q) at the query rows; the error 2 (o (+ k) - v) at the key rows
    {
      const T* op = o.data_ptr<T>();
      const T* xp = kq.data_ptr<T>();
      const T* vp = v.data_ptr<T>();
      T* yp = y.data_ptr<T>();
      T* dp = delta_out.data_ptr<T>();
      const int64_t x_sn = kq.stride(0), v_sn = v.stride(0);
      per_sequence(N, 2 * n * d, [&](int64_t s) {
        const T* o_s = op + s * 2 * n * d;
        const T* x_s = xp + s * x_sn;
        const T* v_s = vp + s * v_sn;
        T* y_s = yp + s * n * d;
        T* d_s = dp + s * n * d;
        for (int64_t i = 0; i < n * d; ++i) {
          const T out_k = residual ? o_s[i] + x_s[i] : o_s[i];
          const T out_q = residual ? o_s[n * d + i] + x_s[n * d + i] : o_s[n * d + i];
          y_s[i] = out_q;
          d_s[i] = T(2) * (out_k - v_s[i]);
        }
      });
    }
    if (depth == 2) {
      // e = delta_out W_2^T, then delta_hid = e * act'(z) at the key rows
      delta_hid = at::bmm(delta_out, ws[1].transpose(1, 2));
      const T* zp = z.data_ptr<T>();
      T* ep = delta_hid.data_ptr<T>();
      per_sequence(N, n * h, [&](int64_t s) {
        const T* z_s = zp + s * 2 * n * h;
        T* e_s = ep + s * n * h;
        if (activation == kRelu) {
          // selected, not multiplied, as torch's threshold_backward: an inf e times 0 would be a NaN
          for (int64_t i = 0; i < n * h; ++i) {
            if (!is_nan(z_s[i]) && z_s[i] <= T(0)) e_s[i] = T(0);
          }
        } else {
          for (int64_t i = 0; i < n * h; ++i) e_s[i] *= act_grad(z_s[i], activation);
        }
      });
    }
    // per token: sq = sum_l ||a_l||^2 ||delta_l||^2, the norm, the clip and mask, and the scaled inputs
    {
      const T* xp = kq.data_ptr<T>();
      const T* gp = gamma.data_ptr<T>();
      const T* bp = beta.data_ptr<T>();
      const T* dop = delta_out.data_ptr<T>();
      const T* dhp = depth == 2 ? delta_hid.data_ptr<T>() : nullptr;
      const T* ap = depth == 2 ? a1.data_ptr<T>() : nullptr;
      T* np = norm.data_ptr<T>();
      T* s0 = scaled[0].data_ptr<T>();
      T* s1 = depth == 2 ? scaled[1].data_ptr<T>() : nullptr;
      const int64_t x_sn = kq.stride(0);
      per_sequence(N, n * (d + h) * 3, [&](int64_t s) {
        for (int64_t j = 0; j < n; ++j) {
          const T* k_j = xp + s * x_sn + j * d;
          const T* do_j = dop + (s * n + j) * d;
          T kk = 0, dd = 0;
          for (int64_t c = 0; c < d; ++c) kk += k_j[c] * k_j[c];
          for (int64_t c = 0; c < d; ++c) dd += do_j[c] * do_j[c];
          T sq;
          const T* a_j = nullptr;
          if (depth == 2) {
            const T* dh_j = dhp + (s * n + j) * h;
            a_j = ap + (s * 2 * n + j) * h;
            T hh = 0, aa = 0;
            for (int64_t c = 0; c < h; ++c) hh += dh_j[c] * dh_j[c];
            for (int64_t c = 0; c < h; ++c) aa += a_j[c] * a_j[c];
            sq = kk * hh + aa * dd;
          } else {
            sq = kk * dd;
          }
          // torch's order and NaN rules: norm = sqrt(max(sq, 1e-30)); scale = min(clip / max(norm, 1e-12),
          // 1) (NaN for a NaN norm); times [norm >= threshold] (0 for a NaN norm: NaN with a clip, else 0)
          const bool nan = is_nan(sq);
          const T nrm = nan ? sq : std::sqrt(std::max(sq, T(1e-30)));
          np[s * n + j] = nrm;
          T scale = T(1);
          if (clip >= 0) scale = nan ? nrm : std::min(T(clip) / std::max(nrm, T(1e-12)), T(1));
          if (threshold >= 0 && (nan || nrm < T(threshold))) scale = (nan && clip >= 0) ? nrm : T(0);
          const T c_w = -gp[s * n + j] * scale, c_s = -bp[s * n + j] * scale;
          T* r0 = s0 + (s * n + j) * 2 * d;
          for (int64_t c = 0; c < d; ++c) {
            r0[c] = c_w * k_j[c];
            r0[d + c] = c_s * k_j[c];
          }
          if (depth == 2) {
            T* r1 = s1 + (s * n + j) * 2 * h;
            for (int64_t c = 0; c < h; ++c) {
              r1[c] = c_w * a_j[c];
              r1[h + c] = c_s * a_j[c];
            }
          }
        }
      });
    }
  });
  // the write: U_l = [c_W a_l | c_S a_l]^T delta_l straight into the new state's buffer, then mix @ X added
  const torch::Tensor deltas[2] = {depth == 2 ? delta_hid : delta_out, delta_out};
  for (int64_t l = 0; l < depth; ++l) {
    const int64_t d_in = states[l].size(2), d_out = states[l].size(3);
    torch::Tensor u = outs[l].view({N, 2 * d_in, d_out});
    at::bmm_out(u, scaled[l].transpose(1, 2), deltas[l]);
    state_mix_forward(states[l].contiguous().view({N, 2, d_in * d_out}), mix, outs[l].view({N, 2, d_in * d_out}));
    if (anchors.empty()) continue;
    // forgetting toward the anchor: W' += (1 - A_b) W_anchor, as `_anchor_`'s addcmul_
    const torch::Tensor anchor = anchors[l].contiguous();
    const int64_t P = d_in * d_out;
    AT_DISPATCH_FLOATING_TYPES(kq.scalar_type(), "chunk_step_anchor", [&] {
      const scalar_t* ap = anchor.data_ptr<scalar_t>();
      const scalar_t* mp = mix.data_ptr<scalar_t>();
      scalar_t* op = outs[l].data_ptr<scalar_t>();
      per_sequence(N, P, [&](int64_t s) {
        const scalar_t pull = scalar_t(1) - mp[s * 4];
        const scalar_t* a_s = ap + s * P;
        scalar_t* w_s = op + s * 2 * P;
        for (int64_t i = 0; i < P; ++i) w_s[i] += a_s[i] * pull;
      });
    });
  }
  return {y, norm};
}
