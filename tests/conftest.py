import os
import sys

# The whole suite runs in the device-faithful CPU mode (megatron_dapo/device_faithful.py): a host/device
# mix-up fails here as it would on a GPU. Subprocesses (torchrun workers, trainer runs) inherit it.
os.environ.setdefault("MEGATRON_DAPO_DEVICE_FAITHFUL", "1")


# tests/gpu/ shares the helpers in this folder.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: spawns several megatron-core processes (minutes on 2 cores)")
