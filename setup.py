"""Builds nf4_ops._C: a CUDA extension when nvcc and a CUDA build of torch are present, else CPU-only.

TORCH_CUDA_ARCH_LIST picks the GPU architectures (default: sm_80, sm_86, sm_89, sm_90).
NF4_OPS_CPU_ONLY=1 forces a CPU-only build.
"""
import os
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

DEFAULT_CUDA_ARCHS = "8.0;8.6;8.9;9.0"
CSRC = Path("csrc")
CPU_SOURCES = ["registration.cpp", "checks.cpp", "dequantize_cpu.cpp", "gemv_cpu.cpp"]
CUDA_SOURCES = ["dequantize.cu", "gemv.cu", "gemv_many_rows.cu"]

# bitsandbytes rounds the nested absmax twice (multiply, then add): no fused multiply-add on the host.
# -fopenmp: torch's CPU build runs at::parallel_for on OpenMP, and its header runs the loop on one thread
# unless the extension is compiled with OpenMP too (linked the same way, it shares torch's libgomp).
CXX_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
LINK_FLAGS = ["-fopenmp"]
# NF4_OPS_NVCC_FLAGS adds flags for kernel tuning builds, e.g. "-DNF4_TC_MIN_TURNS_PER_WARP=4" (see csrc/gemv.cu).
NVCC_FLAGS = ["-O3", "-lineinfo", "-Xcompiler", "-ffp-contract=off"] + os.environ.get("NF4_OPS_NVCC_FLAGS", "").split()


def wheel_cuda_include_dirs() -> list[str]:
    """Headers of the CUDA libraries torch's CUDA wheels depend on (cusparse.h, cublas_v2.h, ...).

    ATen's CUDA headers include them, and an nvcc installed on its own may not ship them.
    """
    try:
        import nvidia  # namespace package of the nvidia-* wheels
    except ImportError:
        return []
    return sorted(str(d) for base in nvidia.__path__ for d in Path(base).glob("cu*/include") if d.is_dir())


def want_cuda() -> bool:
    if os.environ.get("NF4_OPS_CPU_ONLY") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def extension():
    if want_cuda():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
        return CUDAExtension(
            "nf4_ops._C",
            sources=[str(CSRC / s) for s in CPU_SOURCES + CUDA_SOURCES],
            include_dirs=wheel_cuda_include_dirs(),
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
            extra_link_args=LINK_FLAGS,
        )
    return CppExtension(
        "nf4_ops._C",
        sources=[str(CSRC / s) for s in CPU_SOURCES],
        extra_compile_args={"cxx": CXX_FLAGS},
        extra_link_args=LINK_FLAGS,
    )


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExtension})
