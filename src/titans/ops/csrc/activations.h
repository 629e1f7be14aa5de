// SiLU and its derivative for the CPU kernels (causal_conv.cpp, chunk_step.cpp), safe under -ffast-math.
#pragma once
#include <cmath>

namespace titans {

// sigmoid(z) from e = exp(-|z|) in (0, 1]: no exp ever overflows. The build's -ffast-math assumes no inf
// arithmetic, so 1 / (1 + exp(-z)) with exp(-z) = inf (z below about -88.7 in float32) gives NaN there.
template <typename acc_t>
inline acc_t safe_sigmoid(acc_t z) {
  const acc_t e = std::exp(-std::abs(z));
  const acc_t r = acc_t(1) / (acc_t(1) + e);
  return z >= acc_t(0) ? r : e * r;
}

// silu'(z) = s (1 + z (1 - s)), with 1 - s = sigmoid(-z) taken from the same e, not by subtraction: the
// reciprocal that -ffast-math may approximate leaves s = 1 - ulp for large z, and z (1 - s) would then add
// z * ulp (about 6e-4 at z = 1e4 in float32) to a derivative that is 1 there.
template <typename acc_t>
inline acc_t silu_grad(acc_t z) {
  const acc_t e = std::exp(-std::abs(z));
  const acc_t r = acc_t(1) / (acc_t(1) + e);
  const bool pos = z >= acc_t(0);
  const acc_t s = pos ? r : e * r, rest = pos ? e * r : r;
  return s * (acc_t(1) + z * rest);
}

}  // namespace titans
