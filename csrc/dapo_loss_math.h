// Per-token math of the DAPO clipped surrogate, shared by the CPU and CUDA kernels.
//
// For one token with log-ratio x = logp - old_logp and advantage A:
//   r    = exp(clamp(x, -c, c))
//   loss = -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)   (then, with dual clip and A < 0: min(loss, -dual_c*A))
//   dloss/dlogp = -A*r where the unclipped branch is taken and x is inside the clamp, else 0
//   k3   = r - 1 - x   (k3 estimate of KL(old || current), samples drawn from the old policy)
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DAPO_HD __host__ __device__ __forceinline__
#else
#define DAPO_HD inline
#endif

namespace megatron_dapo {

// Slots of the stats vector; ops/dapo_loss_checks.py STAT_NAMES lists the same order.
enum Stat : int {
  kClippedLow = 0,
  kClippedHigh,
  kDualClipped,
  kRatioSum,
  kRatioMax,
  kK3Sum,
  kNumTokens,
  kNumStats
};

template <typename T>
struct DapoParams {
  T lo;        // 1 - eps_low
  T hi;        // 1 + eps_high
  T dual_c;    // dual-clip cap, only read when has_dual
  bool has_dual;
  T clamp;     // bound on |logp - old_logp| before exp
};

template <typename T>
struct TokenOut {
  T loss;   // surrogate loss of the token (unweighted, unnormalised)
  T dloss;  // d loss / d logp (unweighted, unnormalised)
  T ratio;
  T k3;
  T clipped_low;   // 0 or 1
  T clipped_high;  // 0 or 1
  T dual_clipped;  // 0 or 1
};

// exp for the host float path: Cephes' single-precision polynomial (about 1 ulp), written without
// calls or branches so that the compiler vectorises the CPU loop. Valid for |x| <= 87; the callers
// clamp x to at most 80 (log_ratio_clamp is validated against that).
DAPO_HD float exp_poly(float x) {
  const float log2e = 1.44269504088896341f;
  // Round-to-nearest by the 1.5*2^23 trick: vectorises on any SIMD level, unlike floor/rint.
  const float magic = 12582912.0f;
  float n = (x * log2e + magic) - magic;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

DAPO_HD float dapo_exp(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return exp_poly(x);
#endif
}

DAPO_HD double dapo_exp(double x) {
#if defined(__CUDA_ARCH__)
  return ::exp(x);
#else
  return std::exp(x);
#endif
}

template <typename T>
DAPO_HD TokenOut<T> dapo_token(T logp, T old_logp, T adv, const DapoParams<T>& p) {
  const T x_raw = logp - old_logp;
  // torch.clamp passes the gradient on the closed interval; outside it the ratio is constant.
  const bool in_range = (x_raw >= -p.clamp) & (x_raw <= p.clamp);
  const T x = x_raw < -p.clamp ? -p.clamp : (x_raw > p.clamp ? p.clamp : x_raw);
  const T r = dapo_exp(x);
  const T r_clip = r < p.lo ? p.lo : (r > p.hi ? p.hi : r);
  const T s_unclipped = r * adv;
  const T s_clipped = r_clip * adv;
  // min(r*A, clip(r)*A): on a tie both branches carry the same gradient (r is inside the clip range,
  // or A == 0), so taking the unclipped one matches autograd of the reference. A NaN advantage takes it
  // too: its gradient is NaN, as the reference's, not a silent 0 (spelt as a NaN test: GCC does not
  // vectorise the CPU loop over !(s_unclipped > s_clipped)).
  const bool unclipped = (s_unclipped <= s_clipped) | (s_unclipped != s_unclipped);
  T loss = -(unclipped ? s_unclipped : s_clipped);
  T dloss = (unclipped & in_range) ? -adv * r : T(0);
  // Branch-free (bitwise &) so the CPU loop stays vectorisable.
  const T cap = -p.dual_c * adv;
  const bool dual = p.has_dual & (adv < T(0)) & (loss > cap);
  loss = dual ? cap : loss;
  dloss = dual ? T(0) : dloss;
  TokenOut<T> out;
  out.loss = loss;
  out.dloss = dloss;
  out.ratio = r;
  out.k3 = r - T(1) - x;
  out.clipped_low = ((adv < T(0)) & (r < p.lo)) ? T(1) : T(0);
  out.clipped_high = ((adv > T(0)) & (r > p.hi)) ? T(1) : T(0);
  out.dual_clipped = dual ? T(1) : T(0);
  return out;
}

}  // namespace megatron_dapo
