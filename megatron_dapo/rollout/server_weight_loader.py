"""The colocated route's weight loader, run inside our SGLang servers (`--custom-weight-loader`).

SGLang's /update_weights_from_tensor maps the bucket (on GPUs a CUDA buffer of the trainer rank, through IPC),
queues the copies into its weights on its own stream, and answers before they have run: it does not
synchronise after `load_weights`. The trainer refills the same buffer with the next bucket once the call has
answered, so the server could copy the next bucket's bytes as this one's. This loader waits for the copies:
the answer then means the buffer has been read. It imports torch alone: a server imports it at its first update.
"""

import torch

LOADER = f"{__name__}.load_then_wait"  # the import path SGLang is given, and each update names


def load_then_wait(model: torch.nn.Module, named_tensors) -> None:
    model.load_weights(named_tensors)
    device = next(model.parameters()).device
    torch.get_device_module(device).synchronize()  # torch.cpu's returns at once: its copies are done
