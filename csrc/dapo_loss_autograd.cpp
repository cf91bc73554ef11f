// The autograd of megatron_dapo::dapo_loss, in C++. The forward kernel writes d loss / d logp beside the loss,
// so the backward only scales that saved gradient by the upstream one. In Python (torch.library's autograd
// wrapper) this glue cost eight times the CPU kernel of a small call (bench/bench_dapo_loss_overhead.py).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

namespace megatron_dapo {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using FwdSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                     const at::Tensor&, const at::Tensor&, double,
                                                                     double, double, std::optional<double>, double,
                                                                     bool);

// Through the dispatcher, not the kernel itself: under torch.compile the call reaches the fake implementation.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_kernel(const at::Tensor& logp, const at::Tensor& old_logp,
                                                              const at::Tensor& advantages, const at::Tensor& mask,
                                                              double eps_low, double eps_high, double normalizer,
                                                              std::optional<double> dual_clip_c,
                                                              double log_ratio_clamp, bool compute_grad) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("megatron_dapo::dapo_loss_fwd", "")
                             .typed<FwdSignature>();
  return op.call(logp, old_logp, advantages, mask, eps_low, eps_high, normalizer, dual_clip_c, log_ratio_clamp,
                 compute_grad);
}

void scale_in_place(at::Tensor& grad, const at::Tensor& grad_output) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("megatron_dapo::dapo_loss_scale_grad_", "")
                             .typed<void(at::Tensor&, const at::Tensor&)>();
  op.call(grad, grad_output);
}

// The saved gradient is this node's to hand out only in an eager backward that frees the graph after it: not when
// the graph is retained (another backward reads the buffer again), nor while a compiler traces (fake or functional
// tensors, dispatched to Python: the compiler fuses the product itself).
bool may_scale_in_place(const at::Tensor& grad) {
  const auto keys = grad.key_set();
  return !torch::autograd::get_current_graph_task_keep_graph() && !keys.has(c10::DispatchKey::Python) &&
         !keys.has(c10::DispatchKey::Functionalize);
}

class DapoLossFunction : public torch::autograd::Function<DapoLossFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logp, const at::Tensor& old_logp,
                               const at::Tensor& advantages, const at::Tensor& mask, double eps_low, double eps_high,
                               double normalizer, std::optional<double> dual_clip_c, double log_ratio_clamp) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [loss, stats, grad] = forward_kernel(logp, old_logp, advantages, mask, eps_low, eps_high, normalizer,
                                              dual_clip_c, log_ratio_clamp, /*compute_grad=*/true);
    ctx->mark_non_differentiable({stats});
    ctx->set_materialize_grads(false);  // else autograd fills a zero gradient as large as the saved one
    ctx->save_for_backward({grad});
    return {loss, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list grads(9);  // one per input of forward; only logp's is defined
    const at::Tensor& grad_loss = grad_outputs[0];
    if (!grad_loss.defined()) return grads;  // the loss did not reach the graph's output
    at::Tensor unit_grad = ctx->get_saved_variables()[0];
    if (may_scale_in_place(unit_grad)) {
      scale_in_place(unit_grad, grad_loss);  // the kernel skips it when grad_loss is 1 (loss.backward())
      grads[0] = unit_grad;
    } else {
      grads[0] = unit_grad.mul(grad_loss.to(unit_grad.scalar_type()));
    }
    return grads;
  }
};

std::tuple<at::Tensor, at::Tensor> dapo_loss_autograd(const at::Tensor& logp, const at::Tensor& old_logp,
                                                      const at::Tensor& advantages, const at::Tensor& mask,
                                                      double eps_low, double eps_high, double normalizer,
                                                      std::optional<double> dual_clip_c, double log_ratio_clamp) {
  if (!(at::GradMode::is_enabled() && logp.requires_grad())) {  // no gradient wanted: the kernel skips it
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [loss, stats, grad] = forward_kernel(logp, old_logp, advantages, mask, eps_low, eps_high, normalizer,
                                              dual_clip_c, log_ratio_clamp, /*compute_grad=*/false);
    return {loss, stats};
  }
  auto outputs = DapoLossFunction::apply(logp, old_logp, advantages, mask, eps_low, eps_high, normalizer,
                                         dual_clip_c, log_ratio_clamp);
  return {outputs[0], outputs[1]};
}

}  // namespace
}  // namespace megatron_dapo

TORCH_LIBRARY_IMPL(megatron_dapo, Autograd, m) {
  m.impl("dapo_loss", &megatron_dapo::dapo_loss_autograd);
}
