// CPU kernel of the fused DAPO loss: one pass over the tokens computes the loss, the stats and the
// gradient (in the compute dtype: the backward scales it before the one rounding to logp's dtype). Tokens
// are cut into fixed blocks whose partial sums are added in block order, so the result does not depend on
// the number of threads.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <vector>

#include "dapo_loss.h"

namespace megatron_dapo {
namespace {

constexpr int64_t kBlock = 1024;   // tokens summed in the compute dtype before going to float64
constexpr int64_t kGrainBlocks = 16;  // below this many blocks, one thread is faster
constexpr int kSlots = kNumStats + 1;  // stats, then the loss

#define DAPO_BLOCK_PARAMS                                                                                   \
  const scalar_t *__restrict__ logp, const scalar_t *__restrict__ old_logp, const adv_t *__restrict__ adv, \
      const mask_t *__restrict__ mask, int64_t begin, int64_t end, DapoParams<acc_t> p, acc_t inv_norm,    \
      acc_t *__restrict__ grad, double *__restrict__ out
#define DAPO_BLOCK_ARGS logp, old_logp, adv, mask, begin, end, p, inv_norm, grad, out

template <typename scalar_t, typename adv_t, typename mask_t, typename acc_t, bool kGrad>
__attribute__((always_inline)) inline void block_body(DAPO_BLOCK_PARAMS) {
  // Mask weights in the compute dtype first: a byte mask mixed into the float loop vectorises poorly.
  acc_t weights[kBlock];
  const acc_t* wt = weights;
  if constexpr (std::is_same_v<mask_t, acc_t>) {
    wt = mask + begin;
  } else if constexpr (std::is_same_v<mask_t, uint8_t>) {
    for (int64_t i = begin; i < end; ++i) weights[i - begin] = static_cast<acc_t>(mask[i] != 0);
  } else {
    for (int64_t i = begin; i < end; ++i) weights[i - begin] = static_cast<acc_t>(mask[i]);
  }
  acc_t s_loss = 0, s_low = 0, s_high = 0, s_dual = 0, s_ratio = 0, s_k3 = 0, s_n = 0, m_ratio = 0;
#pragma omp simd reduction(+ : s_loss, s_low, s_high, s_dual, s_ratio, s_k3, s_n) reduction(max : m_ratio)
  for (int64_t i = begin; i < end; ++i) {
    const acc_t w = wt[i - begin];
    const bool active = w != acc_t(0);
    const TokenOut<acc_t> t = dapo_token<acc_t>(static_cast<acc_t>(logp[i]), static_cast<acc_t>(old_logp[i]),
                                                static_cast<acc_t>(adv[i]), p);
    // Selects, not products: padding may hold inf/NaN and must not leak into the sums.
    s_loss += active ? t.loss * w : acc_t(0);
    s_low += active ? t.clipped_low : acc_t(0);
    s_high += active ? t.clipped_high : acc_t(0);
    s_dual += active ? t.dual_clipped : acc_t(0);
    s_ratio += active ? t.ratio : acc_t(0);
    s_k3 += active ? t.k3 : acc_t(0);
    s_n += active ? acc_t(1) : acc_t(0);
    m_ratio = (active & (t.ratio > m_ratio)) ? t.ratio : m_ratio;
    if (kGrad) grad[i] = active ? t.dloss * w * inv_norm : acc_t(0);
  }
  out[kClippedLow] = s_low;
  out[kClippedHigh] = s_high;
  out[kDualClipped] = s_dual;
  out[kRatioSum] = s_ratio;
  out[kRatioMax] = m_ratio;
  out[kK3Sum] = s_k3;
  out[kNumTokens] = s_n;
  out[kNumStats] = s_loss;
}

// The same loop compiled twice, for AVX2+FMA and for baseline x86-64, and picked at run time.
#if defined(__x86_64__) && defined(__GNUC__)
template <typename scalar_t, typename adv_t, typename mask_t, typename acc_t, bool kGrad>
__attribute__((target("avx2,fma"))) void block_avx2(DAPO_BLOCK_PARAMS) {
  block_body<scalar_t, adv_t, mask_t, acc_t, kGrad>(DAPO_BLOCK_ARGS);
}

bool cpu_has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

template <typename scalar_t, typename adv_t, typename mask_t, typename acc_t, bool kGrad>
void block_kernel(DAPO_BLOCK_PARAMS) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (cpu_has_avx2_fma()) return block_avx2<scalar_t, adv_t, mask_t, acc_t, kGrad>(DAPO_BLOCK_ARGS);
#endif
  block_body<scalar_t, adv_t, mask_t, acc_t, kGrad>(DAPO_BLOCK_ARGS);
}

template <typename scalar_t, typename adv_t, typename mask_t>
void fwd_typed(const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
               const at::Tensor& mask, const DapoParams<double>& params, double inv_normalizer, at::Tensor& loss,
               at::Tensor& stats, at::Tensor& grad) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  const int64_t n = logp.numel();
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  std::vector<double> partials(static_cast<size_t>(nblocks) * kSlots, 0.0);
  const scalar_t* lp = logp.data_ptr<scalar_t>();
  const scalar_t* olp = old_logp.data_ptr<scalar_t>();
  const adv_t* a = advantages.data_ptr<adv_t>();
  using mask_load_t = std::conditional_t<std::is_same_v<mask_t, bool>, uint8_t, mask_t>;
  const auto* m = reinterpret_cast<const mask_load_t*>(mask.data_ptr<mask_t>());
  acc_t* g = grad.defined() ? grad.data_ptr<acc_t>() : nullptr;
  const DapoParams<acc_t> p = cast_params<acc_t>(params);
  const acc_t inv_norm = static_cast<acc_t>(inv_normalizer);
  at::parallel_for(0, nblocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * kBlock;
      const int64_t end = std::min(n, begin + kBlock);
      double* out = partials.data() + b * kSlots;
      if (g != nullptr) {
        block_kernel<scalar_t, adv_t, mask_load_t, acc_t, true>(lp, olp, a, m, begin, end, p, inv_norm, g, out);
      } else {
        block_kernel<scalar_t, adv_t, mask_load_t, acc_t, false>(lp, olp, a, m, begin, end, p, inv_norm, g, out);
      }
    }
  });
  double total[kSlots] = {0.0};
  for (int64_t b = 0; b < nblocks; ++b) {
    const double* part = partials.data() + b * kSlots;
    for (int s = 0; s < kSlots; ++s) {
      total[s] = (s == kRatioMax) ? std::max(total[s], part[s]) : total[s] + part[s];
    }
  }
  double* st = stats.data_ptr<double>();
  for (int s = 0; s < kNumStats; ++s) st[s] = total[s];
  if (loss.scalar_type() == at::kDouble) {
    *loss.data_ptr<double>() = total[kNumStats] * inv_normalizer;
  } else {
    *loss.data_ptr<float>() = static_cast<float>(total[kNumStats] * inv_normalizer);
  }
}

}  // namespace

void dapo_loss_fwd_cpu(const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
                       const at::Tensor& mask, const DapoParams<double>& params, double inv_normalizer,
                       at::Tensor& loss, at::Tensor& stats, at::Tensor& grad) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logp.scalar_type(), "dapo_loss_fwd_cpu", [&] {
    dispatch_adv_mask(advantages.scalar_type(), mask.scalar_type(), [&](auto adv_tag, auto mask_tag) {
      fwd_typed<scalar_t, decltype(adv_tag), decltype(mask_tag)>(logp, old_logp, advantages, mask, params,
                                                                 inv_normalizer, loss, stats, grad);
    });
  });
}

void dapo_loss_scale_grad_cpu(at::Tensor& grad, const at::Tensor& grad_output) {
  const double g = grad_output.item<double>();
  // loss.backward() passes 1: the forward already wrote the final gradient.
  if (g != 1.0) grad.mul_(g);
}

}  // namespace megatron_dapo
