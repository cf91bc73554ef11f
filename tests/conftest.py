import os
import sys

# tests/gpu/ shares the helpers in this folder.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: spawns several megatron-core processes (minutes on 2 cores)")
