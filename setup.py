"""Build megatron-dapo and its compiled extension megatron_dapo._C.

The C++ CPU kernels are always built. The CUDA kernels are built too when a CUDA toolkit (nvcc) and a
CUDA build of torch are both present, for TORCH_CUDA_ARCH_LIST (default: sm_80 and sm_90, A100 and
H100/H200); nothing needs a GPU at build time. MEGATRON_DAPO_SKIP_CUDA=1 skips the CUDA kernels.
"""

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def _toolkit_root():
    """The CUDA toolkit folder: CUDA_HOME / CUDA_PATH, else what nvcc reports (it may be a wrapper script)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    dry = subprocess.run([nvcc, "--dryrun", "-c", "x.cu"], capture_output=True, text=True)
    match = re.search(r"^#\$ TOP=(.+)$", dry.stdout + dry.stderr, re.MULTILINE)
    return str(Path(match.group(1).strip()).resolve()) if match else str(Path(nvcc).resolve().parent.parent)


def _want_cuda():
    if os.environ.get("MEGATRON_DAPO_SKIP_CUDA", "0") == "1":
        return False, "MEGATRON_DAPO_SKIP_CUDA=1"
    import torch

    if torch.version.cuda is None:
        return False, "torch is a CPU-only build"
    root = _toolkit_root()
    if root is None or not (Path(root) / "bin" / "nvcc").exists():
        return False, "no CUDA toolkit (nvcc) found"
    os.environ["CUDA_HOME"] = root
    return True, f"CUDA toolkit at {root}"


def _extension():
    with_cuda, why = _want_cuda()
    # Imported after CUDA_HOME is settled: cpp_extension reads it at import time.
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    print(f"megatron-dapo: building the CUDA kernels: {with_cuda} ({why})")
    # No FP-exception semantics needed: lets gcc turn the per-token selects into vector blends.
    cxx = ["-O3", "-fopenmp-simd", "-fno-trapping-math"]
    sources = ["csrc/bindings.cpp", "csrc/dapo_loss_autograd.cpp", "csrc/dapo_loss_cpu.cpp"]
    if not with_cuda:
        return CppExtension("megatron_dapo._C", sources, extra_compile_args={"cxx": cxx})
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    include_dirs = []
    # pip's CUDA torch ships the math-library headers (cuBLAS, cuSPARSE) that torch's headers include.
    wheel_include = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13" / "include"
    if wheel_include.is_dir():
        include_dirs.append(str(wheel_include))
    return CUDAExtension(
        "megatron_dapo._C",
        sources + ["csrc/dapo_loss_cuda.cu"],
        include_dirs=include_dirs,
        define_macros=[("MEGATRON_DAPO_WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-lineinfo"]},
    )


def _cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension}


# sglang 0.5.23 has no CPU extra and its metadata pulls CUDA-only packages: where SGLang runs on CPUs
# (development, CI) it is installed with --no-deps on top of these, its pure-Python and CPU needs.
SGLANG_VERSION = "0.5.23"
SGLANG_CPU_DEPS = [
    "aiohttp", "anthropic>=0.20.0", "blobfile==3.0.0", "build", "compressed-tensors==0.18.0", "datasets", "distro",
    "easydict", "einops", "fastapi", "gguf", "interegular", "IPython", "kernels>=0.14.1,<0.15",
    "llguidance>=1.7.6,<2", "mistral_common>=1.11.5", "modelscope", "msgspec", "ninja", "numba==0.65.1", "numpy",
    "nvidia-ml-py", "openai==2.8.0", "openai-harmony==0.0.4", "orjson", "outlines==0.1.11", "packaging",
    "partial_json_parser", "pillow", "prometheus-client>=0.20.0", "psutil", "py-spy", "pybase64", "pydantic",
    "python-dateutil<3", "python-multipart", "pyzmq>=25.1.2", "regex", "requests", "scipy", "sentencepiece==0.2.1",
    "setproctitle", "sglang-router", "smg-grpc-servicer>=0.9.0", "soundfile==0.13.1", "tiktoken",
    "tokenizers==0.23.2", "tqdm",
    "transformers==5.19.0", "uvicorn>=0.51", "uvloop", "watchfiles", "xgrammar==0.2.7", "xxhash", "zstandard",
]

setup(
    name="megatron-dapo",
    version="0.1.0",
    description="DAPO reinforcement learning for reasoning LLMs on Megatron-core, with SGLang rollouts",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.12",
    packages=find_packages(include=["megatron_dapo", "megatron_dapo.*"]),
    # The CPU stand-ins SGLang loads from its PYTHONPATH (not imported by the package itself).
    package_data={"megatron_dapo.rollout": ["cpu_shim/*.py", "cpu_shim/sgl_kernel/*.py",
                                            "cpu_shim/dapo_sglang_cpu_plugin-0.dist-info/*"]},
    ext_modules=[_extension()],
    cmdclass=_cmdclass(),
    install_requires=[
        # sglang 0.5.23 pins torch 2.14.1 and transformers 5.19.0: one environment holds all three.
        "torch==2.14.1",
        "megatron-core==0.16.1",
        "aiohttp>=3.9",  # the SGLang engine's one async HTTP client
        "orjson>=3.9",  # and its JSON decoder
        "pybind11>=2.12",
        "math-verify[antlr4_13_2]>=0.8",
        "matplotlib",
        "numpy",
        "psutil",
        "pyarrow",
        "pyyaml",
        "safetensors",
        "tensorboard",
        "tqdm",
        "transformers==5.19.0",
    ],
    extras_require={
        # NVIDIA apex is not on PyPI (the package of that name there is unrelated): build it from source.
        "gpu": ["transformer-engine[pytorch]", f"sglang=={SGLANG_VERSION}", "sglang-router"],
        "sglang-cpu": SGLANG_CPU_DEPS,
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "filelock", "safetensors", "wandb"],
        "wandb": ["wandb"],  # metrics.wandb
        # bench/bench_vs_trl.py's peer; never a test dependency.
        "bench": ["trl>=1.16", "psutil"],
    },
    entry_points={"console_scripts": ["megatron-dapo=megatron_dapo.cli:main"]},
)
