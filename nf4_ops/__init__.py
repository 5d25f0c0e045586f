"""nf4_ops: bitsandbytes NF4/FP4 dequantize and GEMV as torch operators (torch.ops.nf4.*)."""

import torch  # noqa: F401  (loads libtorch / libc10, which _C links against)

try:
    from . import _C  # noqa: F401  (loading it registers torch.ops.nf4.dequantize / gemv)
except ImportError as error:  # a missing or broken build is an error, never a silent fallback
    raise ImportError(
        "nf4_ops._C (the compiled operators) could not be loaded: "
        f"{error}. Build it from the repository root with "
        "`pip install --no-build-isolation -e .` (scripts/test.sh does all set-up)."
    ) from error

from .ops import dequantize, gemv, quant_state_args
from .patch import is_patched, patch, unpatch

__all__ = ["dequantize", "gemv", "is_patched", "patch", "quant_state_args", "unpatch"]
