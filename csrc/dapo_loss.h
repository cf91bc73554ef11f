// Kernel entry points of the fused DAPO loss; bindings.cpp checks the arguments and dispatches here.
#pragma once

#include <ATen/core/Tensor.h>

#include "dapo_loss_math.h"

namespace megatron_dapo {

// Outputs, allocated by the caller:
//   loss  [] in the compute dtype: sum over masked tokens of mask * token loss, times inv_normalizer
//   stats [kNumStats] float64, see Stat
//   grad  [n] in the compute dtype: d loss / d logp for a unit upstream gradient (undefined: not computed)
void dapo_loss_fwd_cpu(const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
                       const at::Tensor& mask, const DapoParams<double>& params, double inv_normalizer,
                       at::Tensor& loss, at::Tensor& stats, at::Tensor& grad);
void dapo_loss_scale_grad_cpu(at::Tensor& grad, const at::Tensor& grad_output);

#ifdef MEGATRON_DAPO_WITH_CUDA
void dapo_loss_fwd_cuda(const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
                        const at::Tensor& mask, const DapoParams<double>& params, double inv_normalizer,
                        at::Tensor& loss, at::Tensor& stats, at::Tensor& grad);
void dapo_loss_scale_grad_cuda(at::Tensor& grad, const at::Tensor& grad_output);
#endif

// Calls f(adv_t{}, mask_t{}) for the advantages' (float32 / float64) and the mask's (bool / float32) dtypes.
template <typename F>
void dispatch_adv_mask(at::ScalarType adv, at::ScalarType mask, F&& f) {
  if (adv == at::kDouble) {
    if (mask == at::kBool) f(double{}, bool{}); else f(double{}, float{});
  } else {
    if (mask == at::kBool) f(float{}, bool{}); else f(float{}, float{});
  }
}

template <typename T>
DapoParams<T> cast_params(const DapoParams<double>& p) {
  return DapoParams<T>{static_cast<T>(p.lo), static_cast<T>(p.hi), static_cast<T>(p.dual_c), p.has_dual,
                       static_cast<T>(p.clamp)};
}

}  // namespace megatron_dapo
