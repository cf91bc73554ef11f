"""The CPU stand-ins SGLang loads: the seeded sampler's MurmurHash3 against a plain scalar implementation; a CPU
server's processes leave megatron-core unloaded."""

import struct
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron_dapo" / "rollout" / "cpu_shim"))
from murmur_hash import murmur_hash32  # noqa: E402


def murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """The reference algorithm, one 32-bit block at a time in Python integers."""
    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF

    h = seed
    for (k,) in struct.iter_unpack("<I", data):
        k = rotl((k * 0xCC9E2D51) & 0xFFFFFFFF, 15) * 0x1B873593 & 0xFFFFFFFF
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= len(data)
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_murmur_hash_of_seed_position_column_matches_the_reference():
    seeds = torch.tensor([0, 1, -1, 42, -(2**63), 2**63 - 1, 1234567890123])
    positions = torch.tensor([0, 1, 7, 4095, 123456, 2**31 - 1, 3])
    cols = torch.tensor([0, 1, 2, 255, 151935, 2**31 - 1])
    got = murmur_hash32(seeds, positions, cols)
    assert got.dtype == torch.uint32 and got.shape == (len(seeds), len(cols))
    for r, (s, p) in enumerate(zip(seeds.tolist(), positions.tolist())):
        for c, col in enumerate(cols.tolist()):
            words = struct.pack("<IIII", s & 0xFFFFFFFF, (s >> 32) & 0xFFFFFFFF, p, col)
            assert int(got[r, c].item()) == murmur3_x86_32(words), (s, p, col)


def test_a_cpu_servers_processes_do_not_load_megatron_core():
    """SGLang's debug dumper imports megatron.core when it is installed (3.5 s of CPU in each of a server's three
    processes at every start) and takes an ImportError for "not installed"; the shim's sitecustomize gives that
    ImportError in a CPU server's environment, and only there."""
    from megatron_dapo.rollout.sglang_server import SGLangServer, SGLangServerConfig

    probe = "import sys\ntry:\n    import megatron.core\nexcept ImportError as e:\n    print('absent:', e)"
    env = SGLangServer(SGLangServerConfig("m", device="cpu"), "log").environment()
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("absent: import of megatron.core halted"), out.stdout + out.stderr
    gpu = SGLangServer(SGLangServerConfig("m", device="cuda"), "log").environment()
    assert "cpu_shim" not in gpu.get("PYTHONPATH", "")
