"""nf4::dequantize is bit-exact with bitsandbytes' dequantize_4bit over every format variant."""

from __future__ import annotations

import copy
import struct

import pytest
import torch

import nf4_ops
from conftest import (
    ALL_DEVICES, BLOCKSIZES, FLOAT_DTYPES, QUANT_TYPES, STORAGES, bnb_cpu_kernels_from_gpu_build, bnb_cuda_works,
    bnb_dequantize_4bit, bnb_quantize, dtype_id, state_on,
)  # fmt: skip
from nf4_ops.reference import FP4_TABLE, NF4_TABLE, TABLES, dequantize_reference

# K = 304 is no multiple of any blocksize, so blocks straddle rows; N*K/8 is whole, so every
# quant_storage (up to fp32's 4 bytes) holds the packed bytes without padding.
MATRIX_SHAPE = (37, 304)


def bnb_dequantize(quantized, dtype: torch.dtype) -> torch.Tensor:
    state = copy.copy(quantized.quant_state)
    state.dtype = dtype  # bitsandbytes dequantizes to the QuantState's dtype
    return bnb_dequantize_4bit(quantized.packed, state)


def assert_bits_equal(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    int_type = {2: torch.int16, 4: torch.int32}[out.element_size()]
    mismatch = (out.view(int_type) != expected.view(int_type)).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} elements differ, first at {mismatch[0].tolist()}"


def check_against_bitsandbytes(quantized, dtype: torch.dtype, device: str) -> None:
    packed = quantized.packed.to(device)
    out = torch.ops.nf4.dequantize(packed, dtype=dtype, **nf4_ops.quant_state_args(state_on(quantized, device)))
    assert out.device.type == device
    # bitsandbytes' pure-PyTorch fallback gives +0.0 for FP4's nibble 8 where its kernels (and ours) give
    # -0.0; torch.equal compares values, so every other bit must match.
    assert torch.equal(out.cpu(), bnb_dequantize(quantized, dtype).cpu())
    # The reference has the kernels' -0.0: there, every bit must match.
    reference = dequantize_reference(quantized.packed, dtype=dtype, **quantized_args(quantized))
    assert_bits_equal(out.cpu(), reference.cpu())


def quantized_args(quantized) -> dict:
    return nf4_ops.quant_state_args(quantized.quant_state)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("storage", STORAGES, ids=lambda s: "storage_" + dtype_id(s))
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("blocksize", BLOCKSIZES, ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_variant_matrix_bit_exact(quant_type, blocksize, nested, storage, dtype, device):
    quantized = bnb_quantize(MATRIX_SHAPE, quant_type, blocksize, nested, storage)
    check_against_bitsandbytes(quantized, dtype, device)


AWKWARD_SHAPES = {
    "odd_numel": ((33, 77), 64),  # N*K odd: the last byte holds one element
    "one_row": ((1, 4096), 64),
    "k_below_blocksize": ((5, 40), 4096),  # one block for the whole weight
    "many_nested_blocks": ((64, 4160), 1024),  # 260 absmax codes: two nested blocks
    "many_nested_blocks_bs32": ((130, 96), 32),  # 390 absmax codes
}


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("case", list(AWKWARD_SHAPES))
def test_awkward_shapes_bit_exact(case, quant_type, nested, device):
    shape, blocksize = AWKWARD_SHAPES[case]
    quantized = bnb_quantize(shape, quant_type, blocksize, nested)
    for dtype in FLOAT_DTYPES:
        check_against_bitsandbytes(quantized, dtype, device)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_unaligned_packed_view(quant_type, device):
    """A packed tensor that starts one byte into its storage (no 16-byte vector loads) is still exact."""
    quantized = bnb_quantize((40, 320), quant_type, 64, True)
    flat = quantized.packed.flatten()
    storage = torch.empty(flat.numel() + 1, dtype=torch.uint8, device=device)
    storage[1:].copy_(flat)
    shifted = storage[1:]
    assert shifted.data_ptr() % 16 != 0
    args = nf4_ops.quant_state_args(state_on(quantized, device))
    out = torch.ops.nf4.dequantize(shifted, dtype=torch.bfloat16, **args)
    assert torch.equal(out.cpu(), bnb_dequantize(quantized, torch.bfloat16))


@pytest.mark.skipif(not bnb_cuda_works(), reason="bitsandbytes has no working CUDA backend here")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("blocksize", BLOCKSIZES, ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_bit_exact_with_bitsandbytes_cuda(quant_type, blocksize, nested, dtype):
    """Weights quantized by bitsandbytes on the GPU, compared bit for bit with its CUDA dequantize."""
    quantized = bnb_quantize(MATRIX_SHAPE, quant_type, blocksize, nested, torch.uint8, "cuda")
    out = torch.ops.nf4.dequantize(quantized.packed, dtype=dtype, **quantized_args(quantized))
    assert_bits_equal(out, bnb_dequantize(quantized, dtype))


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_kernel_tables_equal_python_tables(quant_type, device):
    """Every nibble through the op with absmax 1.0 gives the C++ table; it must equal the Python copy."""
    packed = torch.tensor([0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF], dtype=torch.uint8, device=device)
    absmax = torch.ones(1, dtype=torch.float32, device=device)
    out = torch.ops.nf4.dequantize(packed, absmax, 32, quant_type, [1, 16], torch.float32)
    assert_bits_equal(out.cpu().flatten(), TABLES[quant_type])


def test_python_tables_match_the_format():
    nf4_bits = [
        0xBF800000, 0xBF3239B1, 0xBF066B30, 0xBECA32A0, 0xBE91A24D, 0xBE3D353F, 0xBDBA7871, 0x00000000,
        0x3DA2FAFF, 0x3E24CAE3, 0x3E7C04DD, 0x3EAD033A, 0x3EE1A4B8, 0x3F1007AB, 0x3F3913B3, 0x3F800000,
    ]  # fmt: skip
    assert [b & 0xFFFFFFFF for b in NF4_TABLE.view(torch.int32).tolist()] == nf4_bits
    import bitsandbytes.functional as bnbf

    assert torch.equal(FP4_TABLE, bnbf.get_4bit_type("fp4", device="cpu"))
    assert torch.equal(NF4_TABLE, bnbf.get_4bit_type("nf4", device="cpu"))
    assert FP4_TABLE[8].item() == 0.0 and torch.signbit(FP4_TABLE[8])


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_python_wrapper_uses_quant_state_dtype(device):
    quantized = bnb_quantize((16, 128), "nf4", 64, True)
    state = state_on(quantized, device)
    out = nf4_ops.dequantize(quantized.packed.to(device), state)
    assert out.dtype == state.dtype == torch.float32
    assert nf4_ops.dequantize(quantized.packed.to(device), state, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(out.cpu(), bnb_dequantize(quantized, torch.float32))


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_out_variant_writes_the_callers_buffer(nested, dtype, device):
    quantized = bnb_quantize(MATRIX_SHAPE, "fp4", 128, nested)
    state = state_on(quantized, device)
    packed = quantized.packed.to(device)
    out = torch.full(MATRIX_SHAPE, float("nan"), dtype=dtype, device=device)  # poisoned: every element must be written
    address = out.data_ptr()
    result = torch.ops.nf4.dequantize.out(packed, dtype=dtype, out=out, **nf4_ops.quant_state_args(state))
    assert result is None  # out-variants return nothing (schema: -> ())
    assert out.data_ptr() == address
    assert_bits_equal(out, torch.ops.nf4.dequantize(packed, dtype=dtype, **nf4_ops.quant_state_args(state)))
    assert nf4_ops.dequantize(packed, state, out=out) is out


def float_of_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


# Scales at the edges of the conversions to the output dtype: Inf, NaN, -0.0, fp32 subnormals, values whose
# products are fp16 subnormals or round to 0 there, fp16 overflow, bf16 rounding up to Inf, an ordinary one; and
# ties, which the codes +-1.0 (in both tables) carry into the products unchanged: bf16 ties with the kept bit odd
# and even and just past a tie (0x3F818000, 0x3F808000, 0x3F808001), fp16 ties both ways (0x3F803000, 0x3F801000).
EDGE_SCALES = [1.0, float("inf"), float("nan"), -0.0, 1e-41, 3e-8, 1e-5, -7e4, 1e5, 3.4e38, -2.5] + [
    float_of_bits(bits) for bits in (0x3F818000, 0x3F808000, 0x3F808001, 0x3F803000, 0x3F801000)
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("blocksize", [64, 256], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_edge_scales_bit_exact_cpu(quant_type, blocksize, dtype):
    """The CPU kernel (on AVX-512 machines its vector path: each block's 16 values converted by one vector
    conversion, whole runs of 64 elements by table permutes) gives every bit of the reference's conversions
    (torch's own fp32 -> fp16 / bf16) for scales at the edges of the output dtype; NaN where the reference has NaN
    (NaN's own bits differ between conversions: torch's vector bf16 conversion gives 0xFFFF, c10's scalar one 0x7FC0)."""
    shape = (24, 512)
    generator = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (shape[0] * shape[1] // 2,), generator=generator, dtype=torch.uint8)
    blocks = shape[0] * shape[1] // blocksize
    absmax = torch.tensor(EDGE_SCALES * (blocks // len(EDGE_SCALES) + 1), dtype=torch.float32)[:blocks]
    args = dict(absmax=absmax, blocksize=blocksize, quant_type=quant_type, shape=list(shape))
    out = torch.ops.nf4.dequantize(packed, dtype=dtype, **args)
    expected = dequantize_reference(packed, dtype=dtype, **args)
    nan = expected.isnan()
    assert nan.any() and torch.equal(out.isnan(), nan)
    assert_bits_equal(out[~nan], expected[~nan])


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_nested_blocksize_other_than_256(device):
    """bitsandbytes always makes nested absmax in blocks of 256, but state2.blocksize says so and the op takes
    nested_blocksize: blocks of 32 give the reference's bits, from the op and from the wrapper (which reads
    state2.blocksize). With 256 everywhere else in the tests, a kernel or wrapper that ignored it would pass them."""
    q = bnb_quantize((130, 96), "nf4", 32, True, device=device)  # 390 absmax codes: 13 nested blocks of 32
    state = copy.copy(q.quant_state)
    state.state2 = copy.copy(state.state2)
    state.state2.blocksize = 32
    scales = torch.rand(-(-state.absmax.numel() // 32), generator=torch.Generator().manual_seed(3)) + 0.5
    state.state2.absmax = scales.to(device)
    args = nf4_ops.quant_state_args(state)
    assert args["nested_blocksize"] == 32
    expected = dequantize_reference(q.packed.cpu(), dtype=torch.float32, **{
        key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in args.items()})
    assert_bits_equal(torch.ops.nf4.dequantize(q.packed, dtype=torch.float32, **args).cpu(), expected)
    assert_bits_equal(nf4_ops.dequantize(q.packed, state, dtype=torch.float32).cpu(), expected)


def test_fp16_nan_with_payload_cpu():
    """A NaN scale whose payload sits in fp32's top mantissa bits gives c10's fp16 NaN, 0x7E00 with the sign, on
    both CPU paths (csrc/cpu_vector.h; scripts/test.sh runs this without AVX-512 too): the hardware conversion alone
    would keep the payload's top bits (0x7E09 here). test_edge_scales_bit_exact_cpu leaves NaN's bits out."""
    nans = [float_of_bits(0x7FC12345), float_of_bits(0xFFC12345)]
    packed = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    out = torch.ops.nf4.dequantize(packed, torch.tensor(nans), 64, "nf4", [1, 128], torch.float16).view(torch.int16)
    c10_nans = torch.tensor([0x7E00] * 64 + [0xFE00 - 0x10000] * 64, dtype=torch.int16)  # block 0's, block 1's
    assert torch.equal(out.flatten(), c10_nans)


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_bnb_fp16_ties(device):
    """Why bnb_dequantize_4bit (conftest.py) takes bitsandbytes' pure-PyTorch implementation as the CPU oracle for
    fp16 where bitsandbytes loaded its CUDA-build library: 0.50.2's CPU dequantize_4bit rounds an fp16 tie to even
    from its CPU-only library, as torch, its CUDA kernels and ours do, but away from zero from its CUDA-build library
    (loaded wherever torch sees a GPU; its CPU code converts in software there). If the bitsandbytes assertion fails,
    bitsandbytes changed: revisit that exception."""
    import bitsandbytes.functional as bnbf

    # nibbles 15 and 0 (NF4's codes 1.0 and -1.0) times 1 + 2^-11: halfway between fp16's 1.0 and 1 + 2^-10
    absmax = torch.tensor([float_of_bits(0x3F801000)], device=device)
    packed = torch.full((32, 1), 0xF0, dtype=torch.uint8, device=device)
    to_even = torch.tensor([1.0, -1.0] * 32, dtype=torch.float16).reshape(1, 64)
    away = torch.tensor([1 + 2**-10, -(1 + 2**-10)] * 32, dtype=torch.float16).reshape(1, 64)
    ours = torch.ops.nf4.dequantize(packed, absmax, 64, "nf4", [1, 64], torch.float16)
    assert torch.equal(ours.cpu(), to_even)
    if device == "cuda" and not bnb_cuda_works():
        pytest.skip("bitsandbytes has no CUDA backend here")
    state = bnbf.QuantState(absmax=absmax, shape=torch.Size([1, 64]), blocksize=64, quant_type="nf4",
                            dtype=torch.float16)  # fmt: skip
    theirs = bnbf.dequantize_4bit(packed, state).cpu()
    assert torch.equal(theirs, away if device == "cpu" and bnb_cpu_kernels_from_gpu_build() else to_even)
