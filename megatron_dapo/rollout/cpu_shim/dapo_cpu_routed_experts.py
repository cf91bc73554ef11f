"""SGLang plugin, found through its entry point when cpu_shim/ is on the path (CPU servers only):
--enable-return-routed-experts on the CPU, as routing replay needs it.

SGLang keeps the captured routes in a host buffer that it allocates through `ALLOC_MEMORY_FUNCS[device]`, whose
default pins the buffer with cudaHostRegister; on a CPU server that call fails for want of a driver and the server
dies at start-up. A CPU server's host buffer is already where the device works, so it is allocated plainly.
"""

import torch


def _alloc_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    return allocator.allocate(dims, dtype=dtype, device=device)


def register():
    from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS

    if not torch.cuda.is_available():
        ALLOC_MEMORY_FUNCS["cpu"] = _alloc_unpinned
