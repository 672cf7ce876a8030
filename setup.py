"""Build megamoe: a CUDA extension when nvcc is found, a C++-only extension otherwise.

The CUDA kernels target Hopper (sm_90a). Without a GPU on the build machine, TORCH_CUDA_ARCH_LIST
defaults to 9.0a (torch cannot guess the arch from a device that is not there). `MEGAMOE_CPU_ONLY=1`
forces the C++-only build.
"""
import glob
import os


def _locate_cuda_home():
    """Where torch would guess wrong: an `nvcc` wrapper on PATH outside the toolkit (e.g. /usr/local/bin)
    makes it take /usr/local as CUDA_HOME. Prefer the toolkit that holds the headers."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    for candidate in ("/usr/local/cuda",):
        if os.path.exists(os.path.join(candidate, "include", "cuda_runtime_api.h")):
            os.environ["CUDA_HOME"] = candidate
            return


_locate_cuda_home()

import torch  # noqa: E402  (after CUDA_HOME is settled: cpp_extension reads it at import)
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def _use_cuda():
    if os.environ.get("MEGAMOE_CPU_ONLY", "0") == "1":
        return False
    # NOTES: gate on the toolkit, not on torch.cuda.is_available(): CI builds the CUDA extension on a
    # machine without a GPU so that the same sources compile everywhere.
    return torch.version.cuda is not None and CUDA_HOME is not None


use_cuda = _use_cuda()
debug = os.environ.get("DEBUG", "0") == "1"
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")

cxx_flags = ["-O0", "-g"] if debug else ["-O3"]
cxx_flags += ["-fdiagnostics-color=always"]
nvcc_flags = ["-O3", "--expt-relaxed-constexpr", "-lineinfo",
              # Kernels use bf16/half arithmetic directly; torch's defaults disable those operators.
              "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"]

# Diagnostic builds: MEGAMOE_NVCC_DEFINES=NAME[,NAME] (e.g. MEGAMOE_TILE_TRACE, see benchmarks/tile_trace.py).
nvcc_flags += [f"-D{name}" for name in os.environ.get("MEGAMOE_NVCC_DEFINES", "").split(",") if name]

sources = _sources("csrc/**/*.cpp")
if not use_cuda:  # the CUDA registrations (csrc/ops/cuda_*.cpp) include the CUDA runtime headers
    sources = [s for s in sources if not os.path.basename(s).startswith("cuda_")]
define_macros = []
if use_cuda:
    sources += _sources("csrc/**/*.cu")
    define_macros.append(("MEGAMOE_WITH_CUDA", "1"))
    ext_cls = CUDAExtension
    extra = {"cxx": cxx_flags, "nvcc": nvcc_flags}
else:
    ext_cls = CppExtension
    extra = {"cxx": cxx_flags}

ext = ext_cls(
    name="megamoe._C",
    sources=sources,
    include_dirs=[os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")],
    define_macros=define_macros,
    extra_compile_args=extra,
)

setup(
    name="megamoe",
    version="0.1.0",
    packages=find_packages(include=["megamoe", "megamoe.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension},
    install_requires=["torch>=2.11"],
    # safetensors: only for megamoe.load_experts_from_safetensors and the checkpoint tool.
    extras_require={"checkpoint": ["safetensors"], "test": ["pytest", "safetensors"]},
    python_requires=">=3.10",
)
