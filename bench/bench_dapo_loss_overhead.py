"""The fused loss's host overhead per call: what `dapo_loss` forward + backward costs beyond its kernels, at token
counts where the kernels take next to nothing, so the time left is Python, autograd and dispatch (the same code
path on every device). Side by side in one run:

- kernel: `torch.ops.megatron_dapo.dapo_loss_fwd` alone, the gradient computed (no autograd: the floor of one
  launch);
- op + autograd: `torch.ops.megatron_dapo.dapo_loss`, forward + backward through its autograd (C++);
- dapo_loss: the public function (checks, the op, the stats), forward + backward.

    python bench/bench_dapo_loss_overhead.py [--tokens 16 100000] [--device cpu cuda] [--reps 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_dapo.ops.dapo_loss import dapo_loss

KW = dict(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)


def inputs(n: int, device: str):
    g = torch.Generator().manual_seed(0)
    logp = -2.0 + 0.5 * torch.randn(n, generator=g)
    old = logp + 0.2 * torch.randn(n, generator=g)
    return [t.to(device) for t in (logp, old, torch.randn(n, generator=g), torch.rand(n, generator=g) > 0.1)]


def variants(logp, old, adv, mask):
    n = float(logp.numel())
    ops = torch.ops.megatron_dapo

    def kernel():
        ops.dapo_loss_fwd(logp, old, adv, mask, 0.2, 0.28, n, 3.0, 20.0, True)

    def op_autograd():
        x = logp.detach().requires_grad_()
        ops.dapo_loss(x, old, adv, mask, 0.2, 0.28, n, 3.0, 20.0)[0].backward()

    def public():
        x = logp.detach().requires_grad_()
        dapo_loss(x, old, adv, mask, normalizer=n, **KW)[0].backward()

    return {"kernel": kernel, "op + autograd": op_autograd, "dapo_loss": public}


def per_call_us(fn, device: str, reps: int) -> float:
    for _ in range(max(reps // 10, 2)):
        fn()
    rounds = []
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) / reps * 1e6)
    return statistics.median(rounds)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", nargs="+", type=float, default=[16, 1e5])
    parser.add_argument("--device", nargs="+", default=["cpu", "cuda"], choices=["cpu", "cuda"])
    parser.add_argument("--reps", type=int, default=2000)
    args = parser.parse_args()
    for device in args.device:
        if device == "cuda" and not torch.cuda.is_available():
            print("cuda: no device, skipped")
            continue
        print(f"\n== {device}: per call, median of 5 rounds of {args.reps} ==")
        print(f"{'tokens':>8} {'kernel us':>10} {'op+autograd us':>15} {'dapo_loss us':>13} {'autograd/kernel':>16} "
              f"{'dapo_loss/kernel':>17} {'host overhead us':>17}")
        for n in map(int, args.tokens):
            t = {name: per_call_us(fn, device, args.reps) for name, fn in variants(*inputs(n, device)).items()}
            k, a, d = t["kernel"], t["op + autograd"], t["dapo_loss"]
            print(f"{n:>8} {k:>10.1f} {a:>15.1f} {d:>13.1f} {a / k:>16.2f} {d / k:>17.2f} {d - k:>17.1f}")


if __name__ == "__main__":
    main()
