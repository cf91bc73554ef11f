"""SGLang plugin, found through its entry point when cpu_shim/ is on the path (CPU servers only): a CPU server
forks its scheduler and detokenizer from the launcher instead of spawning them.

SGLang spawns them because a CUDA context cannot cross a fork. A CPU server has none, and a spawned child imports
SGLang, transformers and torch's compiler stack again before it does anything: 10 s of CPU in each of the two,
two thirds of a server's start-up (28 -> 12 CPU-s measured on a tiny model, ready in 14 s instead of 21). The
launcher has run no torch op when it forks, so no thread pool is copied half-used.
"""

import logging
import multiprocessing

import torch

logger = logging.getLogger(__name__)
SET_ENVS = "sglang.srt.entrypoints.engine._set_envs_and_config"  # ends with set_start_method("spawn")


def _fork_children(result, *args, **kwargs):
    multiprocessing.set_start_method("fork", force=True)
    logger.info("CPU server: its scheduler and detokenizer are forked from the launcher")
    return result


def register():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not torch.cuda.is_available():
        HookRegistry.register(SET_ENVS, _fork_children, HookType.AFTER)
