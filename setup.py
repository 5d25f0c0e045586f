"""Builds nf4_ops._C: a CUDA extension when nvcc and a CUDA build of torch are present, else CPU-only.

TORCH_CUDA_ARCH_LIST picks the GPU architectures (default: sm_80, sm_86, sm_89, sm_90a). sm_90a (H100, H200) has
the warpgroup gemv kernel (wgmma, csrc/gemv.cu); a build whose only sm_90 target is sm_90a turns it on
(NF4_WGMMA_SM90A), one with plain sm_90 code ("9.0") keeps the tensor-core kernel on those GPUs.
NF4_OPS_CPU_ONLY=1 forces a CPU-only build.
"""
import os
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

DEFAULT_CUDA_ARCHS = "8.0;8.6;8.9;9.0a"
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


def wheel_cuda_include_flags() -> list[str]:
    """Headers of the CUDA libraries torch's CUDA wheels depend on (cusparse.h, cublas_v2.h, ...), as -isystem flags.

    ATen's CUDA headers include them, and an nvcc installed on its own may not ship them. They go after the
    toolkit's own headers (-isystem is searched after every -I, CUDA_HOME/include among them): torch 2.15's wheels
    carry CUDA 13.2's runtime headers, which put before a CUDA 13.0 nvcc's stop its CCCL headers with "CUDA
    compiler and CUDA toolkit headers are incompatible".
    """
    try:
        import nvidia  # namespace package of the nvidia-* wheels
    except ImportError:
        return []
    dirs = sorted(str(d) for base in nvidia.__path__ for d in Path(base).glob("cu*/include") if d.is_dir())
    return [flag for d in dirs for flag in ("-isystem", d)]  # nvcc takes "-isystem DIR", not "-isystemDIR"


def want_cuda() -> bool:
    if os.environ.get("NF4_OPS_CPU_ONLY") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def wgmma_flags(arch_list: str) -> list[str]:
    """NF4_WGMMA_SM90A=1 where sm_90a is the build's only sm_90 target: an H100 or H200 then runs sm_90a code, which
    has the warpgroup kernel (a build with plain sm_90 code too might run that, where the kernel is a trap)."""
    archs = {a.strip().removesuffix("+PTX") for a in arch_list.replace(",", ";").replace(" ", ";").split(";")}
    return ["-DNF4_WGMMA_SM90A=1"] if "9.0a" in archs and "9.0" not in archs else []


def extension():
    if want_cuda():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
        wgmma = wgmma_flags(os.environ["TORCH_CUDA_ARCH_LIST"])
        wheel_headers = wheel_cuda_include_flags()
        return CUDAExtension(
            "nf4_ops._C",
            sources=[str(CSRC / s) for s in CPU_SOURCES + CUDA_SOURCES],
            extra_compile_args={"cxx": CXX_FLAGS + wgmma + wheel_headers, "nvcc": NVCC_FLAGS + wgmma + wheel_headers},
            extra_link_args=LINK_FLAGS,
        )
    return CppExtension(
        "nf4_ops._C",
        sources=[str(CSRC / s) for s in CPU_SOURCES],
        extra_compile_args={"cxx": CXX_FLAGS},
        extra_link_args=LINK_FLAGS,
    )


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExtension})
