// Registers the fused DAPO loss with torch.library: argument checks that name the bad argument,
// output allocation, and the device dispatch. The math lives in dapo_loss_math.h, the autograd in
// dapo_loss_autograd.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include "dapo_loss.h"

namespace megatron_dapo {
namespace {

constexpr double kMaxLogRatioClamp = 80.0;  // exp(80) still fits in float32

void check_1d(const at::Tensor& t, const char* name, const at::Tensor& logp) {
  TORCH_CHECK_VALUE(t.dim() == 1, "dapo_loss: ", name, " must be 1-D (one entry per token), got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.numel() == logp.numel(), "dapo_loss: ", name, " has ", t.numel(), " tokens but logp has ",
                    logp.numel());
  TORCH_CHECK_VALUE(t.device() == logp.device(), "dapo_loss: ", name, " is on ", t.device(), " but logp is on ",
                    logp.device());
}

void check_args(const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
                const at::Tensor& mask, double eps_low, double eps_high, double normalizer,
                std::optional<double> dual_clip_c, double log_ratio_clamp) {
  TORCH_CHECK_VALUE(logp.dim() == 1, "dapo_loss: logp must be 1-D (one entry per token), got shape ", logp.sizes());
  check_1d(old_logp, "old_logp", logp);
  check_1d(advantages, "advantages", logp);
  check_1d(mask, "mask", logp);
  const auto lt = logp.scalar_type();
  TORCH_CHECK_TYPE(lt == at::kFloat || lt == at::kBFloat16 || lt == at::kHalf || lt == at::kDouble,
                   "dapo_loss: logp must be float32, bfloat16, float16 or float64, got ", lt);
  TORCH_CHECK_TYPE(old_logp.scalar_type() == lt, "dapo_loss: old_logp must have logp's dtype ", lt, ", got ",
                   old_logp.scalar_type());
  TORCH_CHECK_TYPE(advantages.scalar_type() == at::kFloat || advantages.scalar_type() == at::kDouble,
                   "dapo_loss: advantages must be float32 or float64, got ", advantages.scalar_type());
  TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool || mask.scalar_type() == at::kFloat,
                   "dapo_loss: mask must be bool or float32, got ", mask.scalar_type());
  TORCH_CHECK_VALUE(eps_low > 0.0 && eps_low < 1.0, "dapo_loss: eps_low must be in (0, 1), got ", eps_low);
  TORCH_CHECK_VALUE(eps_high > 0.0, "dapo_loss: eps_high must be > 0, got ", eps_high);
  TORCH_CHECK_VALUE(normalizer > 0.0, "dapo_loss: normalizer must be > 0, got ", normalizer);
  TORCH_CHECK_VALUE(!dual_clip_c.has_value() || *dual_clip_c > 1.0, "dapo_loss: dual_clip_c must be > 1, got ",
                    dual_clip_c.value_or(0.0));
  TORCH_CHECK_VALUE(log_ratio_clamp > 0.0 && log_ratio_clamp <= kMaxLogRatioClamp,
                    "dapo_loss: log_ratio_clamp must be in (0, ", kMaxLogRatioClamp, "], got ", log_ratio_clamp);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dapo_loss_fwd(const at::Tensor& logp_in, const at::Tensor& old_in,
                                                             const at::Tensor& adv_in, const at::Tensor& mask_in,
                                                             double eps_low, double eps_high, double normalizer,
                                                             std::optional<double> dual_clip_c,
                                                             double log_ratio_clamp, bool compute_grad) {
  check_args(logp_in, old_in, adv_in, mask_in, eps_low, eps_high, normalizer, dual_clip_c, log_ratio_clamp);
  const at::Tensor logp = logp_in.contiguous();
  const at::Tensor old_logp = old_in.contiguous();
  const at::Tensor advantages = adv_in.contiguous();
  const at::Tensor mask = mask_in.contiguous();
  const auto compute_dtype = logp.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor loss = at::empty({}, logp.options().dtype(compute_dtype));
  at::Tensor stats = at::empty({kNumStats}, logp.options().dtype(at::kDouble));
  // In the compute dtype: the backward scales it by the upstream gradient before rounding to logp's dtype.
  at::Tensor grad = at::empty({compute_grad ? logp.numel() : 0}, logp.options().dtype(compute_dtype));
  at::Tensor grad_arg = compute_grad ? grad : at::Tensor();
  const DapoParams<double> params{1.0 - eps_low, 1.0 + eps_high, dual_clip_c.value_or(0.0), dual_clip_c.has_value(),
                                  log_ratio_clamp};
  if (logp.is_cuda()) {
#ifdef MEGATRON_DAPO_WITH_CUDA
    dapo_loss_fwd_cuda(logp, old_logp, advantages, mask, params, 1.0 / normalizer, loss, stats, grad_arg);
#else
    TORCH_CHECK(false, "dapo_loss: megatron_dapo._C was built without CUDA; rebuild with a CUDA toolkit present");
#endif
  } else {
    dapo_loss_fwd_cpu(logp, old_logp, advantages, mask, params, 1.0 / normalizer, loss, stats, grad_arg);
  }
  return {loss, stats, grad};
}

// dapo_loss where no gradient is wanted (below autograd, or nothing requires one): the loss and stats alone.
std::tuple<at::Tensor, at::Tensor> dapo_loss_no_grad(const at::Tensor& logp, const at::Tensor& old_logp,
                                                     const at::Tensor& advantages, const at::Tensor& mask,
                                                     double eps_low, double eps_high, double normalizer,
                                                     std::optional<double> dual_clip_c, double log_ratio_clamp) {
  auto [loss, stats, grad] = dapo_loss_fwd(logp, old_logp, advantages, mask, eps_low, eps_high, normalizer,
                                           dual_clip_c, log_ratio_clamp, /*compute_grad=*/false);
  return {loss, stats};
}

void dapo_loss_scale_grad_(at::Tensor& grad, const at::Tensor& grad_output) {
  TORCH_CHECK_VALUE(grad_output.numel() == 1, "dapo_loss backward: grad_output must hold one element, got ",
                    grad_output.sizes());
  TORCH_CHECK_VALUE(grad.is_contiguous(), "dapo_loss backward: grad must be contiguous");
  TORCH_CHECK_TYPE(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kDouble,
                   "dapo_loss backward: grad must be in the compute dtype, float32 or float64, got ",
                   grad.scalar_type());
  if (grad.is_cuda()) {
#ifdef MEGATRON_DAPO_WITH_CUDA
    dapo_loss_scale_grad_cuda(grad, grad_output.to(grad.device(), grad.scalar_type()).contiguous());
#else
    TORCH_CHECK(false, "dapo_loss: megatron_dapo._C was built without CUDA");
#endif
  } else {
    dapo_loss_scale_grad_cpu(grad, grad_output);
  }
}

}  // namespace
}  // namespace megatron_dapo

TORCH_LIBRARY(megatron_dapo, m) {
  // The loss and its stats, differentiable in logp (what megatron_dapo.ops.dapo_loss calls).
  m.def(
      "dapo_loss(Tensor logp, Tensor old_logp, Tensor advantages, Tensor mask, float eps_low, float eps_high, "
      "float normalizer, float? dual_clip_c, float log_ratio_clamp) -> (Tensor loss, Tensor stats)");
  // The kernel: the loss, its stats and, with compute_grad, d loss / d logp for a unit upstream gradient (in the
  // compute dtype, float32 or float64).
  m.def(
      "dapo_loss_fwd(Tensor logp, Tensor old_logp, Tensor advantages, Tensor mask, float eps_low, "
      "float eps_high, float normalizer, float? dual_clip_c, float log_ratio_clamp, bool compute_grad) "
      "-> (Tensor loss, Tensor stats, Tensor grad)");
  // Multiplies the forward's unit gradient by the upstream gradient, in place; skips the pass when it is 1.
  m.def("dapo_loss_scale_grad_(Tensor(a!) grad, Tensor grad_output) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_dapo, CompositeExplicitAutograd, m) {
  m.impl("dapo_loss", &megatron_dapo::dapo_loss_no_grad);
}

TORCH_LIBRARY_IMPL(megatron_dapo, CPU, m) {
  m.impl("dapo_loss_fwd", &megatron_dapo::dapo_loss_fwd);
  m.impl("dapo_loss_scale_grad_", &megatron_dapo::dapo_loss_scale_grad_);
}

#ifdef MEGATRON_DAPO_WITH_CUDA
TORCH_LIBRARY_IMPL(megatron_dapo, CUDA, m) {
  m.impl("dapo_loss_fwd", &megatron_dapo::dapo_loss_fwd);
  m.impl("dapo_loss_scale_grad_", &megatron_dapo::dapo_loss_scale_grad_);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Compiled kernels of megatron-dapo; the ops register under torch.ops.megatron_dapo on import.";
#ifdef MEGATRON_DAPO_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
