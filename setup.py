"""Builds nf4_ops._C: a CUDA extension when torch is a CUDA build and CUDA_HOME has an nvcc of its major CUDA
version and its runtime library, else CPU-only (saying why). Where CUDA_HOME is not set and the nvcc on PATH is a
wrapper outside the toolkit, /usr/local/cuda is taken (take_default_cuda_home_over_a_wrapper).

TORCH_CUDA_ARCH_LIST picks the GPU architectures (default: sm_80, sm_86, sm_89, sm_90a). sm_90a (H100, H200) has
the warpgroup gemv kernel (wgmma, csrc/gemv.cu); a build whose only sm_90 target is sm_90a turns it on
(NF4_WGMMA_SM90A), one with plain sm_90 code ("9.0") keeps the tensor-core kernel on those GPUs.
NF4_OPS_CPU_ONLY=1 forces a CPU-only build.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from setuptools import setup

DEFAULT_CUDA_HOME = Path("/usr/local/cuda")  # torch's own last guess


def has_cuda_runtime(cuda_home: Path) -> bool:
    """Whether cuda_home has the CUDA runtime library that torch links a CUDA extension against (-lcudart, from lib64
    or lib)."""
    return any((cuda_home / lib / "libcudart.so").exists() for lib in ("lib64", "lib"))


def take_default_cuda_home_over_a_wrapper() -> None:
    """torch takes CUDA_HOME from the environment, else from the nvcc on PATH (its bin folder's parent), else
    /usr/local/cuda. An nvcc on PATH that is a wrapper script (/usr/local/bin/nvcc exec'ing the toolkit's) makes that
    /usr/local, with no runtime library: the build then failed at its last step (cannot find -lcudart), minutes in.
    Where the environment names no CUDA_HOME and the PATH guess has no runtime library, /usr/local/cuda is taken if
    it is a whole toolkit. Before torch.utils.cpp_extension is imported, which reads CUDA_HOME once."""
    nvcc = shutil.which("nvcc")
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or nvcc is None:
        return
    guess = Path(nvcc).parent.parent
    if not has_cuda_runtime(guess) and has_cuda_runtime(DEFAULT_CUDA_HOME) and (DEFAULT_CUDA_HOME / "bin" / "nvcc").is_file():
        print(f"nf4_ops: CUDA_HOME={DEFAULT_CUDA_HOME}: the nvcc on PATH ({nvcc}) would make it {guess}, which has no CUDA "
              f"runtime library to link", file=sys.stderr)  # fmt: skip
        os.environ["CUDA_HOME"] = str(DEFAULT_CUDA_HOME)


take_default_cuda_home_over_a_wrapper()
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

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


def wheel_cuda_include_flags() -> dict[str, list[str]]:
    """Headers of the CUDA libraries torch's CUDA wheels depend on (cusparse.h, cublas_v2.h, ...), per compiler.

    ATen's CUDA headers include them, and an nvcc installed on its own may not ship them. They are searched last
    (-idirafter: after every -I and -isystem, nvcc's own CCCL directory among them), so a header the toolkit has is
    always the toolkit's: torch 2.15's wheels carry CUDA 13.2's headers, which put before a CUDA 13.0 nvcc's (as
    -I, until e94b152) stopped its CCCL headers with "CUDA compiler and CUDA toolkit headers are incompatible".
    nvcc hands -Xcompiler options to the host compiler's preprocessing of the device passes too.
    """
    try:
        import nvidia  # namespace package of the nvidia-* wheels
    except ImportError:
        return {"cxx": [], "nvcc": []}
    dirs = sorted(str(d) for base in nvidia.__path__ for d in Path(base).glob("cu*/include") if d.is_dir())
    return {
        "cxx": [flag for d in dirs for flag in ("-idirafter", d)],
        "nvcc": [flag for d in dirs for flag in ("-Xcompiler", f"-idirafter,{d}")],
    }


def nvcc_version(cuda_home: str) -> str | None:
    """The CUDA release of CUDA_HOME's nvcc ("13.0"), or None where there is no nvcc (a runtime-only CUDA install)."""
    nvcc = Path(cuda_home) / "bin" / "nvcc"
    if not nvcc.is_file():
        return None
    found = re.search(r"release (\d+\.\d+)", subprocess.run([str(nvcc), "--version"], capture_output=True,
                                                            text=True).stdout)  # fmt: skip
    return found.group(1) if found else None


def want_cuda() -> bool:
    """The CUDA kernels are built where torch is a CUDA build and CUDA_HOME has an nvcc of torch's major CUDA version
    (torch's build refuses another) and the runtime library to link; else the build is CPU-only and says why."""
    if os.environ.get("NF4_OPS_CPU_ONLY") == "1":
        return False
    if torch.version.cuda is None:
        return False  # a CPU build of torch
    major = torch.version.cuda.split(".")[0]
    nvcc = nvcc_version(CUDA_HOME) if CUDA_HOME else None
    if nvcc is None or nvcc.split(".")[0] != major:
        if CUDA_HOME is None:
            found = "torch found no CUDA_HOME (no nvcc on PATH or under /usr/local/cuda)"
        else:
            found = f"CUDA_HOME={CUDA_HOME} has " + (f"nvcc {nvcc}" if nvcc else "no bin/nvcc")
        print(f"nf4_ops: CPU-only build: the CUDA kernels of torch {torch.__version__} need an nvcc of CUDA {major}.x, "
              f"and {found}", file=sys.stderr)  # fmt: skip
        return False
    if not has_cuda_runtime(Path(CUDA_HOME)):
        print(f"nf4_ops: CPU-only build: CUDA_HOME={CUDA_HOME} has nvcc {nvcc} but no CUDA runtime library to link "
              f"(lib64/libcudart.so or lib/libcudart.so); set CUDA_HOME to the whole toolkit", file=sys.stderr)
        return False
    return True


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
            extra_compile_args={
                "cxx": CXX_FLAGS + wgmma + wheel_headers["cxx"],
                "nvcc": NVCC_FLAGS + wgmma + wheel_headers["nvcc"],
            },
            extra_link_args=LINK_FLAGS,
        )
    return CppExtension(
        "nf4_ops._C",
        sources=[str(CSRC / s) for s in CPU_SOURCES],
        extra_compile_args={"cxx": CXX_FLAGS},
        extra_link_args=LINK_FLAGS,
    )


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExtension})
