// CUDA kernels of the fused DAPO loss. One pass reads logp, old_logp, advantages and mask once and
// writes the gradient once, in the compute dtype (17 bytes per fp32 token with a bool mask); per-block
// partial sums go to a small buffer that one block then reduces in a fixed order, so results are
// run-to-run identical.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "dapo_loss.h"

namespace megatron_dapo {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kSlots = kNumStats + 1;  // stats, then the loss
constexpr int kBlocksPerSm = 8;

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T>
__device__ __forceinline__ T mask_weight(bool m) { return m ? T(1) : T(0); }
template <typename T>
__device__ __forceinline__ T mask_weight(float m) { return static_cast<T>(m); }

__device__ __forceinline__ double combine(int slot, double a, double b) {
  return slot == kRatioMax ? fmax(a, b) : a + b;
}

// Reduces each slot over the block; thread 0 gets the result.
__device__ void block_reduce(double (&v)[kSlots]) {
  __shared__ double smem[kSlots][kWarps];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v[s] = combine(s, v[s], __shfl_down_sync(0xffffffffu, v[s], off));
    if (lane == 0) smem[s][warp] = v[s];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      v[s] = lane < kWarps ? smem[s][lane] : 0.0;
#pragma unroll
      for (int off = 16; off > 0; off /= 2) v[s] = combine(s, v[s], __shfl_down_sync(0xffffffffu, v[s], off));
    }
  }
}

template <typename acc_t>
struct ThreadAcc {
  acc_t loss = 0, low = 0, high = 0, dual = 0, ratio = 0, k3 = 0, n = 0, max_ratio = 0;

  template <typename scalar_t, typename adv_t, typename mask_t>
  __device__ __forceinline__ acc_t add(scalar_t lp, scalar_t olp, adv_t a, mask_t m, const DapoParams<acc_t>& p,
                                       acc_t inv_norm) {
    const acc_t w = mask_weight<acc_t>(m);
    const bool active = w != acc_t(0);
    const TokenOut<acc_t> t =
        dapo_token<acc_t>(static_cast<acc_t>(lp), static_cast<acc_t>(olp), static_cast<acc_t>(a), p);
    if (active) {
      loss += t.loss * w;
      low += t.clipped_low;
      high += t.clipped_high;
      dual += t.dual_clipped;
      ratio += t.ratio;
      k3 += t.k3;
      n += acc_t(1);
      max_ratio = t.ratio > max_ratio ? t.ratio : max_ratio;
    }
    return active ? t.dloss * w * inv_norm : acc_t(0);
  }
};

template <typename scalar_t, typename adv_t, typename mask_t, typename acc_t, int VEC, bool kGrad>
__global__ void __launch_bounds__(kThreads)
    fwd_kernel(const scalar_t* __restrict__ logp, const scalar_t* __restrict__ old_logp,
               const adv_t* __restrict__ adv, const mask_t* __restrict__ mask, int64_t n, DapoParams<acc_t> p,
               acc_t inv_norm, acc_t* __restrict__ grad, double* __restrict__ partials) {
  ThreadAcc<acc_t> acc;
  const int64_t nvec = n / VEC;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (int64_t v = tid; v < nvec; v += stride) {
    const Pack<scalar_t, VEC> lp = reinterpret_cast<const Pack<scalar_t, VEC>*>(logp)[v];
    const Pack<scalar_t, VEC> olp = reinterpret_cast<const Pack<scalar_t, VEC>*>(old_logp)[v];
    const Pack<adv_t, VEC> a = reinterpret_cast<const Pack<adv_t, VEC>*>(adv)[v];
    const Pack<mask_t, VEC> m = reinterpret_cast<const Pack<mask_t, VEC>*>(mask)[v];
    Pack<acc_t, VEC> g;
#pragma unroll
    for (int j = 0; j < VEC; ++j) g.v[j] = acc.add(lp.v[j], olp.v[j], a.v[j], m.v[j], p, inv_norm);
    if (kGrad) reinterpret_cast<Pack<acc_t, VEC>*>(grad)[v] = g;
  }
  for (int64_t i = nvec * VEC + tid; i < n; i += stride) {
    const acc_t gi = acc.add(logp[i], old_logp[i], adv[i], mask[i], p, inv_norm);
    if (kGrad) grad[i] = gi;
  }
  double v[kSlots];
  v[kClippedLow] = acc.low;
  v[kClippedHigh] = acc.high;
  v[kDualClipped] = acc.dual;
  v[kRatioSum] = acc.ratio;
  v[kRatioMax] = acc.max_ratio;
  v[kK3Sum] = acc.k3;
  v[kNumTokens] = acc.n;
  v[kNumStats] = acc.loss;
  block_reduce(v);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) partials[blockIdx.x * kSlots + s] = v[s];
  }
}

template <typename loss_t>
__global__ void __launch_bounds__(kThreads)
    finalize_kernel(const double* __restrict__ partials, int nblocks, double inv_norm, loss_t* __restrict__ loss,
                    double* __restrict__ stats) {
  double v[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) v[s] = 0.0;
  for (int b = threadIdx.x; b < nblocks; b += kThreads) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) v[s] = combine(s, v[s], partials[b * kSlots + s]);
  }
  block_reduce(v);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kNumStats; ++s) stats[s] = v[s];
    *loss = static_cast<loss_t>(v[kNumStats] * inv_norm);
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    scale_kernel(scalar_t* __restrict__ grad, const scalar_t* __restrict__ grad_output, int64_t n) {
  const scalar_t s = *grad_output;
  // loss.backward() passes 1: the forward already wrote the final gradient, nothing to move.
  if (s == scalar_t(1)) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) grad[i] *= s;
}

// ATen reads each device's properties once: a cudaDeviceGetAttribute per launch cost host time on every call.
int sm_count(int device) {
  return at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device))->multiProcessorCount;
}

template <int VEC, typename T>
bool aligned(const T* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % (sizeof(T) * VEC) == 0;
}

template <typename scalar_t, typename adv_t, typename mask_t, int VEC>
void launch(const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages, const at::Tensor& mask,
            const DapoParams<double>& params, double inv_normalizer, at::Tensor& loss, at::Tensor& stats,
            at::Tensor& grad) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  const int64_t n = logp.numel();
  const int64_t work = std::max<int64_t>(1, (n / VEC + kThreads - 1) / kThreads);
  const int nblocks = static_cast<int>(std::min<int64_t>(work, int64_t(sm_count(logp.get_device())) * kBlocksPerSm));
  at::Tensor partials = at::empty({nblocks * kSlots}, logp.options().dtype(at::kDouble));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const DapoParams<acc_t> p = cast_params<acc_t>(params);
  const auto* lp = logp.data_ptr<scalar_t>();
  const auto* olp = old_logp.data_ptr<scalar_t>();
  const auto* a = advantages.data_ptr<adv_t>();
  const auto* m = mask.data_ptr<mask_t>();
  if (grad.defined()) {
    fwd_kernel<scalar_t, adv_t, mask_t, acc_t, VEC, true><<<nblocks, kThreads, 0, stream>>>(
        lp, olp, a, m, n, p, static_cast<acc_t>(inv_normalizer), grad.data_ptr<acc_t>(), partials.data_ptr<double>());
  } else {
    fwd_kernel<scalar_t, adv_t, mask_t, acc_t, VEC, false><<<nblocks, kThreads, 0, stream>>>(
        lp, olp, a, m, n, p, static_cast<acc_t>(inv_normalizer), nullptr, partials.data_ptr<double>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (loss.scalar_type() == at::kDouble) {
    finalize_kernel<double><<<1, kThreads, 0, stream>>>(partials.data_ptr<double>(), nblocks, inv_normalizer,
                                                        loss.data_ptr<double>(), stats.data_ptr<double>());
  } else {
    finalize_kernel<float><<<1, kThreads, 0, stream>>>(partials.data_ptr<double>(), nblocks, inv_normalizer,
                                                       loss.data_ptr<float>(), stats.data_ptr<double>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename adv_t, typename mask_t>
void fwd_typed(const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
               const at::Tensor& mask, const DapoParams<double>& params, double inv_normalizer, at::Tensor& loss,
               at::Tensor& stats, at::Tensor& grad) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  // 16-byte loads of the log-probs when every array lines up; slices that do not take the scalar path.
  constexpr int VEC = 16 / sizeof(scalar_t);
  const bool vec_ok = aligned<VEC>(logp.data_ptr<scalar_t>()) && aligned<VEC>(old_logp.data_ptr<scalar_t>()) &&
                      aligned<VEC>(advantages.data_ptr<adv_t>()) && aligned<VEC>(mask.data_ptr<mask_t>()) &&
                      (!grad.defined() || aligned<VEC>(grad.data_ptr<acc_t>()));
  if (vec_ok) {
    launch<scalar_t, adv_t, mask_t, VEC>(logp, old_logp, advantages, mask, params, inv_normalizer, loss, stats, grad);
  } else {
    launch<scalar_t, adv_t, mask_t, 1>(logp, old_logp, advantages, mask, params, inv_normalizer, loss, stats, grad);
  }
}

}  // namespace

void dapo_loss_fwd_cuda(const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
                        const at::Tensor& mask, const DapoParams<double>& params, double inv_normalizer,
                        at::Tensor& loss, at::Tensor& stats, at::Tensor& grad) {
  const c10::cuda::CUDAGuard guard(logp.device());
  if (logp.numel() == 0) {
    loss.zero_();
    stats.zero_();
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logp.scalar_type(), "dapo_loss_fwd_cuda", [&] {
    dispatch_adv_mask(advantages.scalar_type(), mask.scalar_type(), [&](auto adv_tag, auto mask_tag) {
      fwd_typed<scalar_t, decltype(adv_tag), decltype(mask_tag)>(logp, old_logp, advantages, mask, params,
                                                                 inv_normalizer, loss, stats, grad);
    });
  });
}

void dapo_loss_scale_grad_cuda(at::Tensor& grad, const at::Tensor& grad_output) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t n = grad.numel();
  if (n == 0) return;
  const int64_t work = (n + kThreads - 1) / kThreads;
  const int nblocks = static_cast<int>(std::min<int64_t>(work, int64_t(sm_count(grad.get_device())) * kBlocksPerSm));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "dapo_loss_scale_grad_cuda", [&] {
    scale_kernel<scalar_t><<<nblocks, kThreads, 0, stream>>>(grad.data_ptr<scalar_t>(),
                                                             grad_output.data_ptr<scalar_t>(), n);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace megatron_dapo
