// The chunk step's state update X' = mix @ X + U per sequence n (X = [W; S] as (2, P) rows, U the
// chunk's weighted gradient sums), forward and backward, for titans/ops/memory.py (tested against bmms).
//
// Forward: the caller's matmul writes U straight into the new state's buffer; one pass then adds mix @ X to
// it in place (reading X, reading and writing X'), instead of a separate U buffer or a bmm writing mix @ X
// and a baddbmm accumulating U into it.
// Backward: g_mix[n] += g[n] @ X[n]^T (the four inner products) and g_X[n] = mix[n]^T @ g[n], in ONE
// pass over g and X instead of two (a bmm for each reads all of g).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

void state_mix_forward(torch::Tensor x, torch::Tensor mix, torch::Tensor out) {
  // x, out: (N, 2, P) contiguous, one dtype, not overlapping; mix: (N, 2, 2) contiguous.
  // out holds U on entry and X' = mix @ X + U on exit.
  const int64_t N = x.size(0), P = x.size(2);
  const int64_t piece = 1 << 14;  // elements of a row per task
  const int64_t pieces = (P + piece - 1) / piece;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "state_mix_forward", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* mp = mix.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N * pieces, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t n = task / pieces, i0 = (task % pieces) * piece, i1 = std::min(P, i0 + piece);
        const scalar_t m00 = mp[n * 4], m01 = mp[n * 4 + 1], m10 = mp[n * 4 + 2], m11 = mp[n * 4 + 3];
        const scalar_t* __restrict__ x0 = xp + n * 2 * P;
        const scalar_t* __restrict__ x1 = x0 + P;
        scalar_t* __restrict__ o0 = op + n * 2 * P;
        scalar_t* __restrict__ o1 = o0 + P;
        for (int64_t i = i0; i < i1; ++i) {
          const scalar_t w = x0[i], s = x1[i];
          o0[i] += m00 * w + m01 * s;
          o1[i] += m10 * w + m11 * s;
        }
      }
    });
  });
}

void state_mix_backward(torch::Tensor g, torch::Tensor x, torch::Tensor mix, c10::optional<torch::Tensor> g_x,
                        c10::optional<torch::Tensor> g_mix) {
  // g, x, g_x: (N, 2, P) contiguous, one dtype; mix, g_mix: (N, 2, 2) contiguous
  const int64_t N = g.size(0), P = g.size(2);
  const int64_t piece = 1 << 14;  // elements of a row per task
  const int64_t pieces = (P + piece - 1) / piece;
  // each task's four sums, added over a row's pieces in order after the loop (not in the order threads
  // finish: a run's gradients are the same from one run to the next)
  std::vector<double> partials(N * pieces * 4, 0.0);
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "state_mix_backward", [&] {
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* mp = mix.data_ptr<scalar_t>();
    scalar_t* gxp = g_x.has_value() ? g_x->data_ptr<scalar_t>() : nullptr;
    const bool want_mix = g_mix.has_value();
    at::parallel_for(0, N * pieces, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t n = task / pieces, i0 = (task % pieces) * piece, i1 = std::min(P, i0 + piece);
        const scalar_t* g0 = gp + n * 2 * P;
        const scalar_t* g1 = g0 + P;
        const scalar_t* x0 = xp + n * 2 * P;
        const scalar_t* x1 = x0 + P;
        if (want_mix) {
          // a piece's sums in scalar_t (vectorised: -ffast-math lets the compiler split them into lane-wise
          // partial sums), the pieces' totals in double
          scalar_t s00 = 0, s01 = 0, s10 = 0, s11 = 0;
          for (int64_t i = i0; i < i1; ++i) {
            const scalar_t a = g0[i], b = g1[i], w = x0[i], s = x1[i];
            s00 += a * w;
            s01 += a * s;
            s10 += b * w;
            s11 += b * s;
          }
          double* part = partials.data() + task * 4;
          part[0] = s00;
          part[1] = s01;
          part[2] = s10;
          part[3] = s11;
        }
        if (gxp) {
          const scalar_t m00 = mp[n * 4], m01 = mp[n * 4 + 1], m10 = mp[n * 4 + 2], m11 = mp[n * 4 + 3];
          scalar_t* o0 = gxp + n * 2 * P;
          scalar_t* o1 = o0 + P;
          for (int64_t i = i0; i < i1; ++i) {
            const scalar_t a = g0[i], b = g1[i];
            o0[i] = m00 * a + m10 * b;
            o1[i] = m01 * a + m11 * b;
          }
        }
      }
    });
    if (want_mix) {
      scalar_t* out = g_mix->data_ptr<scalar_t>();
      for (int64_t n = 0; n < N; ++n) {
        double sums[4] = {0.0, 0.0, 0.0, 0.0};
        for (int64_t i = 0; i < pieces; ++i) {
          for (int64_t k = 0; k < 4; ++k) sums[k] += partials[(n * pieces + i) * 4 + k];
        }
        for (int64_t k = 0; k < 4; ++k) out[n * 4 + k] += static_cast<scalar_t>(sums[k]);
      }
    }
  });
}
