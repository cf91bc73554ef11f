// The autograd of megatron_dapo::dapo_loss, in C++. The forward kernel writes d loss / d logp beside the loss, in
// the compute dtype (float32; float64 for float64 logp), so the backward only scales that saved gradient by the
// upstream one and rounds the product once to logp's dtype. In Python (torch.library's autograd wrapper) this glue
// cost eight times the CPU kernel of a small call (bench/bench_dapo_loss_overhead.py).
//
// Supported: first-order gradients in logp, in reverse mode (backward, torch.autograd.grad), the graph freed or
// retained, batched upstream gradients (is_grads_batched, jacobian(vectorize=True)), torch.compile and compiled
// autograd. Refused with NotImplementedError, rather than silently wrong: forward-mode AD, gradients of old_logp,
// advantages or a float mask, second-order gradients, and torch.func's gradient transforms. dapo_loss_reference
// supports them all.
#include <ATen/FuncTorchTLS.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include <utility>

namespace megatron_dapo {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kUseReference = "; dapo_loss_reference (plain PyTorch, the same arguments) supports it";

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

// The saved gradient is this node's to hand out only in an eager backward that frees the graph after it (another
// backward reads the buffer again), on plain tensors (a compiler's fake or functional tensors and vmap's batched
// upstream gradients take the functional product), and when it has logp's dtype already (not for 16-bit logp).
bool may_scale_in_place(const at::Tensor& unit_grad, const at::Tensor& grad_loss, at::ScalarType dtype) {
  return unit_grad.scalar_type() == dtype && !torch::autograd::get_current_graph_task_keep_graph() &&
         !at::areAnyTensorSubclassLike({unit_grad, grad_loss});
}

// unit_grad * grad_loss in the compute dtype, rounded once to logp's dtype: a 16-bit product of the two would lose
// a loss-scaled gradient to overflow, and a large normaliser's unit gradient to underflow.
at::Tensor scaled(const at::Tensor& unit_grad, const at::Tensor& grad_loss, at::ScalarType dtype) {
  if (at::areAnyTensorSubclassLike({unit_grad, grad_loss})) return unit_grad.mul(grad_loss).to(dtype);
  at::Tensor out = at::empty(unit_grad.sizes(), unit_grad.options().dtype(dtype));
  return at::mul_out(out, unit_grad, grad_loss);  // one pass, stored rounded
}

// Under create_graph the gradient is handed out through this node, whose backward refuses: the C++ counterpart of
// once_differentiable. Its inputs are logp and the upstream gradient, so that every second-order use reaches it,
// even one that differentiates in logp alone (where a gradient that did not require grad would read as 0).
class FirstOrderOnly : public torch::autograd::Function<FirstOrderOnly> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const at::Tensor& logp, const at::Tensor& grad_loss,
                               const at::Tensor& unit_grad) {
    return {scaled(unit_grad, grad_loss, logp.scalar_type())};
  }

  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grad_outputs*/) {
    TORCH_CHECK_NOT_IMPLEMENTED(false,
                                "dapo_loss: second-order gradients (double backward, a Hessian or Hessian-vector "
                                "product: the gradient differentiated again) are not supported; it is differentiable "
                                "once",
                                kUseReference);
  }
};

class DapoLossFunction : public torch::autograd::Function<DapoLossFunction> {
 public:
  // The stats leave through `stats`, not as an output marked non-differentiable: compiled autograd refuses marks.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logp, const at::Tensor& old_logp,
                               const at::Tensor& advantages, const at::Tensor& mask, double eps_low, double eps_high,
                               double normalizer, std::optional<double> dual_clip_c, double log_ratio_clamp,
                               at::Tensor* stats) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [loss, stats_out, grad] = forward_kernel(logp, old_logp, advantages, mask, eps_low, eps_high, normalizer,
                                                  dual_clip_c, log_ratio_clamp, /*compute_grad=*/true);
    *stats = stats_out;
    ctx->set_materialize_grads(false);  // else autograd fills a zero gradient as large as the saved one
    ctx->save_for_backward({logp, grad});  // logp: its dtype, and the edge a second-order use is refused along
    return {loss};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list grads(10);  // one per argument of forward; only logp's is defined
    const at::Tensor& grad_loss = grad_outputs[0];
    if (!grad_loss.defined()) return grads;  // the loss did not reach the graph's output
    variable_list saved = ctx->get_saved_variables();
    const at::Tensor& logp = saved[0];
    at::Tensor& unit_grad = saved[1];
    if (at::GradMode::is_enabled()) {  // create_graph: the gradient may be differentiated again
      grads[0] = FirstOrderOnly::apply(logp, grad_loss, unit_grad)[0];
    } else if (may_scale_in_place(unit_grad, grad_loss, logp.scalar_type())) {
      scale_in_place(unit_grad, grad_loss);  // the kernel skips it when grad_loss is 1 (loss.backward())
      grads[0] = unit_grad;
    } else {
      grads[0] = scaled(unit_grad, grad_loss, logp.scalar_type());
    }
    return grads;
  }
};

// What this autograd would get silently wrong, refused by name: a tangent (its outputs would carry none) and a
// gradient wanted for an input other than logp (it would stay None).
void refuse_unsupported(const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
                        const at::Tensor& mask) {
  const std::pair<const char*, const at::Tensor*> inputs[] = {
      {"logp", &logp}, {"old_logp", &old_logp}, {"advantages", &advantages}, {"mask", &mask}};
  for (const auto& [name, t] : inputs) {
    TORCH_CHECK_NOT_IMPLEMENTED(!t->_fw_grad(/*level=*/0).defined(),
                                "dapo_loss: forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) is not "
                                "supported, and ", name, " carries a tangent: differentiate in reverse mode "
                                "(backward, torch.autograd.grad)", kUseReference);
  }
  if (!at::GradMode::is_enabled()) return;
  for (const auto& [name, t] : inputs) {
    TORCH_CHECK_NOT_IMPLEMENTED(t == &logp || !t->requires_grad(), "dapo_loss: ", name,
                                " requires grad, but the op is differentiable in logp alone: pass ", name,
                                ".detach() if no gradient is meant to reach it", kUseReference);
  }
}

// torch refuses a C++ autograd Function inside torch.func's transforms (Function::apply), without naming the op or
// the way that works: the same check, its error said again.
void refuse_inside_torch_func() {
  const auto& functorch_tls = at::functorch::functorchTLSAccessor();
  if (!functorch_tls) return;
  try {
    functorch_tls->checkSupportsCppAutogradFunction();
  } catch (const c10::Error&) {
    TORCH_CHECK_NOT_IMPLEMENTED(false,
                                "dapo_loss: gradients inside torch.func's transforms (grad, vjp, jacrev, or vmap with "
                                "logp requiring grad) are not supported: take them with torch.autograd.grad "
                                "(is_grads_batched=True for a batch of upstream gradients)", kUseReference);
  }
}

std::tuple<at::Tensor, at::Tensor> dapo_loss_autograd(const at::Tensor& logp, const at::Tensor& old_logp,
                                                      const at::Tensor& advantages, const at::Tensor& mask,
                                                      double eps_low, double eps_high, double normalizer,
                                                      std::optional<double> dual_clip_c, double log_ratio_clamp) {
  refuse_unsupported(logp, old_logp, advantages, mask);
  if (!(at::GradMode::is_enabled() && logp.requires_grad())) {  // no gradient wanted: the kernel skips it
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [loss, stats, grad] = forward_kernel(logp, old_logp, advantages, mask, eps_low, eps_high, normalizer,
                                              dual_clip_c, log_ratio_clamp, /*compute_grad=*/false);
    return {loss, stats};
  }
  refuse_inside_torch_func();
  at::Tensor stats;
  auto outputs = DapoLossFunction::apply(logp, old_logp, advantages, mask, eps_low, eps_high, normalizer,
                                         dual_clip_c, log_ratio_clamp, &stats);
  return {outputs[0], stats};
}

}  // namespace
}  // namespace megatron_dapo

TORCH_LIBRARY_IMPL(megatron_dapo, Autograd, m) {
  m.impl("dapo_loss", &megatron_dapo::dapo_loss_autograd);
}
