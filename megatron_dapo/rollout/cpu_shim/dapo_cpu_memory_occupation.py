"""SGLang plugin, found through its entry point when cpu_shim/ is on the path (CPU servers only):
/release_memory_occupation on the CPU, as colocated runs call it between rollout and training.

SGLang's release ends with `torch.get_device_module().synchronize()`. On a CUDA build of torch without
a GPU that module is torch.cuda, whose synchronize() fails for want of a driver and takes the scheduler
(and the server) down. A CPU server has no device queue to wait for, so the call is skipped there.
"""

import torch

RELEASE = ("sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
           ".release_memory_occupation")


def _release_without_device_sync(original, self, recv_req):
    synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None
    try:
        return original(self, recv_req)
    finally:
        torch.cuda.synchronize = synchronize


def register():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not torch.cuda.is_available():
        HookRegistry.register(RELEASE, _release_without_device_sync, HookType.AROUND)
