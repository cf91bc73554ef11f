"""How fast the weights leave Megatron for the servers on one device: the weight sync's export path against a device
copy of the same bytes, in one run.

The model is Qwen2.5-1.5B-shaped (launch/models/Qwen2.5-1.5B/config.json; random weights) at the dtype a run trains
in (bf16 on GPUs), one rank (TP = 1: one GPU). The export is what every push route runs before its transport:
weight_sync/buckets.py's iter_hf_buckets (megatron's tensors gathered over TP, mapped to Hugging Face names and
shapes, QKV and gate/up split, packed into buckets of --bucket-mb), each bucket then copied into a receiving
buffer on the same device, as a server's side of the sync would hold it. The reference is one device-to-device
copy of all the model's bytes. Best of --repeats after a warm-up; GB = 10^9 bytes.

On the CPU with MEGATRON_DAPO_DEVICE_FAITHFUL=1 (the suite, --tiny) the export follows the GPU's placement.

    python bench/bench_export.py [--device cuda] [--bucket-mb 512] [--repeats 5]
    python bench/bench_export.py --device cpu --tiny       # the suite's size
"""

from __future__ import annotations

import argparse
import time

import torch
from model_shapes import one_rank



def best_seconds(fn, device: torch.device, repeats: int) -> float:
    def sync():
        if device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(device)

    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model of the same shape (the suite)")
    parser.add_argument("--bucket-mb", type=float, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0

    from megatron_dapo.parallel.runtime import shutdown_runtime
    from megatron_dapo.policy.model import build_model
    from megatron_dapo.weight_sync.buckets import bucket_bytes_from_mb, iter_hf_buckets, model_bytes

    rank = one_rank(args.device, args.tiny, "bench_export_")
    spec, parallel, device, dtype = rank.spec, rank.parallel, rank.device, rank.dtype
    model = build_model(spec, parallel, pre_process=True, post_process=True, params_dtype=dtype)
    bucket_bytes = bucket_bytes_from_mb(args.bucket_mb)
    total = model_bytes(spec, dtype)
    receiver = torch.empty(0, dtype=torch.uint8, device=device)  # grown to the largest bucket in the warm-up
    buckets = []

    def export():
        nonlocal receiver
        buckets.clear()
        for bucket in iter_hf_buckets(model, spec, parallel, bucket_bytes):
            if bucket.nbytes > receiver.numel():
                receiver = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
            receiver[: bucket.nbytes].copy_(bucket.flat)
            buckets.append(bucket.nbytes)

    source, target = (torch.empty(total, dtype=torch.uint8, device=device) for _ in range(2))
    export_s = best_seconds(export, device, args.repeats)
    copy_s = best_seconds(lambda: target.copy_(source), device, args.repeats)
    shutdown_runtime()
    if sum(buckets) != total:
        raise SystemExit(f"the export moved {sum(buckets)} bytes, the model has {total}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available() else "cpu"
    print(f"\n== export: {'tiny ' if args.tiny else ''}Qwen2.5-1.5B shape, {str(dtype).removeprefix('torch.')}, "
          f"{name}, TP 1, {len(buckets)} buckets of <= {args.bucket_mb:g} MB; best of {args.repeats} ==")
    print(f"model GB        {total / 1e9:.3f}")
    print(f"export s        {export_s:.4f}  {total / export_s / 1e9:.1f} GB/s")
    print(f"device copy s   {copy_s:.4f}  {total / copy_s / 1e9:.1f} GB/s")
    print(f"export / copy   {copy_s / export_s:.2f} of the copy's bandwidth")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
