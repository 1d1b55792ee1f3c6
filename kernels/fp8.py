"""FP8 formats, the in-kernel FP8 encoder and amax, and the pure-torch quantization reference.

The kernels never use Triton's fp32 -> fp8 conversion. They round to the FP8 grid with integer
arithmetic and store the byte codes as uint8, which the launchers view as the FP8 dtype:

- it is exact round-to-nearest-even with saturation on every backend, the Triton interpreter
  included (the interpreter's own fp8 cast rounds some ties up and carries into the exponent);
- a kernel that stores both a row-wise and a transposed copy of converted fp8 values has been
  seen to write foreign bytes into the transposed copy on Hopper with the ptxas Triton 3.6
  bundles, while 8-bit integer stores through the same layout conversion are clean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["FORMAT_DTYPES", "FP8Format", "FP8_FORMATS", "fp8_codes", "fp8_encode", "fp8_encode_ptx", "fp8_encode_ptx4", "fp8_format",
           "fp8_tile_codes",
           "pass_scale", "quantize_reference", "scale_from_amax",
           "scale_from_amax_reference", "scale_quotient"]


@dataclass(frozen=True)
class FP8Format:
    dtype: torch.dtype
    code: int  # the kernels' FP8_FORMAT constexpr: 1 = e4m3fn, 2 = e5m2 (0 means "no FP8")
    max: float  # largest finite value; saturation clamps here
    mantissa_bits: int
    exponent_bias: int


FP8_FORMATS: dict[torch.dtype, FP8Format] = {
    torch.float8_e4m3fn: FP8Format(torch.float8_e4m3fn, 1, 448.0, 3, 7),
    torch.float8_e5m2: FP8Format(torch.float8_e5m2, 2, 57344.0, 2, 15),
}


FORMAT_DTYPES: dict[int, torch.dtype] = {fmt.code: fmt.dtype for fmt in FP8_FORMATS.values()}  # by kernel code


def fp8_format(fp8_dtype: object, argument: str = "fp8_dtype", optional: bool = True) -> FP8Format:
    """The format of ``fp8_dtype``, or a ``ValueError`` naming what is accepted (``None`` too where the
    caller takes it: ``optional``)."""
    fmt = FP8_FORMATS.get(fp8_dtype) if isinstance(fp8_dtype, torch.dtype) else None  # a list is unhashable
    if fmt is None:
        accepted = ", ".join(str(d) for d in FP8_FORMATS)
        raise ValueError(f"`{argument}` must be one of {accepted}{' (or None)' if optional else ''}; "
                         f"got {fp8_dtype!r}")
    return fmt


@triton.jit
def fp8_encode(x, FP8_FORMAT: tl.constexpr):
    """Byte codes (int32 in 0..255) of fp32 ``x`` in e4m3fn (1) or e5m2 (2): nearest-even, saturating.

    NaN maps to 0x7F/0xFF (NaN in both formats); +-inf and anything past the finite max saturate.
    """
    if FP8_FORMAT == 1:
        MANTISSA: tl.constexpr = 3
        MIN_NORMAL_EXP: tl.constexpr = 121  # fp32 biased exponent of 2**-6, e4m3's smallest normal
        MAX_BITS: tl.constexpr = 0x43E00000  # 448.0
    else:
        MANTISSA: tl.constexpr = 2
        MIN_NORMAL_EXP: tl.constexpr = 113  # 2**-14
        MAX_BITS: tl.constexpr = 0x47600000  # 57344.0
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    is_nan = magnitude > 0x7F800000
    magnitude = tl.minimum(magnitude, MAX_BITS)
    exponent = magnitude >> 23
    subnormal = exponent < MIN_NORMAL_EXP
    # Normals keep their own bits (exponent and mantissa shift together, a rounding carry bumps
    # the exponent); subnormals shift the 24-bit significand so one unit is the format's
    # smallest subnormal. 31 is enough to flush anything that small to zero.
    shift = tl.where(subnormal, tl.minimum(MIN_NORMAL_EXP - exponent + (23 - MANTISSA), 31), 23 - MANTISSA)
    source = tl.where(subnormal, (magnitude & 0x7FFFFF) | 0x800000, magnitude)
    kept = source >> shift
    below = source >> (shift - 1)
    round_bit = below & 1
    sticky = (source - (below << (shift - 1))) != 0
    rounded = kept + (round_bit & (sticky.to(tl.int32) | (kept & 1)))
    code = tl.where(subnormal, rounded, rounded - ((MIN_NORMAL_EXP - 1) << MANTISSA))
    code = tl.where(is_nan, 0x7F, code)
    return code | sign


@triton.jit
def fp8_encode_ptx(x, FP8_FORMAT: tl.constexpr):
    """``fp8_encode`` through the hardware conversion (sm_89+): one ``cvt`` per element instead of
    about twenty integer operations. The result is a plain int32 code, so no fp8-typed value ever
    reaches a layout conversion or a store."""
    if FP8_FORMAT == 1:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 pair; cvt.rn.satfinite.e4m3x2.f32 pair, $1, $1; cvt.u32.u16 $0, pair; and.b32 $0, $0, 255; }",
            "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 pair; cvt.rn.satfinite.e5m2x2.f32 pair, $1, $1; cvt.u32.u16 $0, pair; and.b32 $0, $0, 255; }",
            "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def fp8_encode_ptx4(x, FP8_FORMAT: tl.constexpr):
    """``fp8_encode_ptx`` converting two values per ``cvt`` and packing four codes per register:
    three instructions for four values instead of twelve. Returns uint8 codes."""
    if FP8_FORMAT == 1:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r", [x], dtype=tl.uint8, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1; cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r", [x], dtype=tl.uint8, is_pure=True, pack=4)


def _tile_asm(kind: str) -> str:
    """``fp8_tile_codes``'s PTX for one FP8 kind (``e4m3`` or ``e5m2``). Operands, four elements per
    instance: ``$0..$3`` the codes of row sets 0-3 (four bytes each, element ``k`` in byte ``k``),
    ``$4..$7`` the words of elements 0-3 (row set ``j`` in byte ``j``), ``$8 + 4 j + k`` element ``k``
    of row set ``j``. Each ``cvt`` converts two row sets of one element (the second operand into the
    low byte); eight ``prmt`` then turn the four words into the four row sets' codes (a 4 x 4 byte
    transpose)."""
    cvt = f"cvt.rn.satfinite.{kind}x2.f32"
    asm = ["{ .reg .b16 lo, hi; .reg .b32 s<4>;"]
    for k in range(4):
        asm.append(f"{cvt} lo, ${12 + k}, ${8 + k}; {cvt} hi, ${20 + k}, ${16 + k}; mov.b32 ${4 + k}, {{lo, hi}};")
    asm.append("prmt.b32 s0, $4, $5, 0x5140; prmt.b32 s1, $4, $5, 0x7362;")  # w0.b0 w1.b0 w0.b1 w1.b1 / bytes 2, 3
    asm.append("prmt.b32 s2, $6, $7, 0x5140; prmt.b32 s3, $6, $7, 0x7362;")
    asm.append("prmt.b32 $0, s0, s2, 0x5410; prmt.b32 $1, s0, s2, 0x7632;")  # byte 0 of w0..w3 / byte 1
    asm.append("prmt.b32 $2, s1, s3, 0x5410; prmt.b32 $3, s1, s3, 0x7632; }")
    return " ".join(asm)


_TILE_ASM_E4M3 = tl.constexpr(_tile_asm("e4m3"))
_TILE_ASM_E5M2 = tl.constexpr(_tile_asm("e5m2"))
_TILE_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 16))  # 4 + 4 outputs, 16 inputs


@triton.jit
def fp8_tile_codes(x0, x1, x2, x3, FP8_FORMAT: tl.constexpr):
    """FP8 codes of four row sets ``x0..x3`` (fp32, one shape and layout) through the hardware
    conversion (sm_89+), in both layouts a pass stores: each set's codes (uint8), and per element the
    32-bit word of its four codes, set ``j`` in byte ``j`` (four consecutive rows of one column: a
    word of the transposed copy). Two values per conversion and a byte transpose in registers:
    about one instruction per element, where ``fp8_codes`` per value, masking and packing each
    layout took 3.5 (BENCHMARKS.md). The codes are ``fp8_encode_ptx``'s, bit for bit."""
    return tl.inline_asm_elementwise(_TILE_ASM_E4M3 if FP8_FORMAT == 1 else _TILE_ASM_E5M2, _TILE_CONSTRAINTS,
                                     [x0, x1, x2, x3], dtype=(tl.uint8, tl.uint8, tl.uint8, tl.uint8, tl.int32),
                                     is_pure=True, pack=4)


@triton.jit
def fp8_codes(x, FP8_FORMAT: tl.constexpr, ENCODER: tl.constexpr):
    """FP8 byte codes (int32 in 0..255) of fp32 ``x``; ``_launch.fp8_encoder`` picks ``ENCODER``:
    integer arithmetic (0), the per-value hardware conversion (1; also 3, whose passes convert
    through ``fp8_tile_codes`` where they can) or the packed one (2). Callers truncate to uint8 for
    stores and transpose the int32 form (fp8.py's module docstring)."""
    if ENCODER == 2:
        return fp8_encode_ptx4(x, FP8_FORMAT).to(tl.int32)
    elif ENCODER == 1 or ENCODER == 3:
        return fp8_encode_ptx(x, FP8_FORMAT)
    else:
        return fp8_encode(x, FP8_FORMAT)


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def amax_update(acc, x):
    """The running elementwise max of ``|x|`` that a kernel keeps for its amax. A NaN stays NaN: one
    NaN-propagating max per element instead of a compare, a select and a max."""
    return _max_keeping_nan(acc, tl.abs(x))


@triton.jit
def amax_finish(acc):
    """The amax of a program's accumulator, a NaN anywhere mapped to +inf (non-finite, and an ordered
    value for the atomic max across programs)."""
    largest = tl.reduce(acc, None, _max_keeping_nan)
    return tl.where(largest == largest, largest, float("inf"))


@triton.jit
def pass_scale(scale_ptr, amax_ptr, margin_factor, writer, FP8_FORMAT: tl.constexpr, SCALE_FROM_AMAX: tl.constexpr):
    """The FP8 scale a pass casts with: read from ``scale_ptr``, or, with ``SCALE_FROM_AMAX`` (current
    scaling's second pass), derived from the amax at ``amax_ptr`` (``scale_from_amax``) and stored at
    ``scale_ptr`` by the program for which ``writer`` is true. 1.0 without an FP8 format (not read)."""
    scale = 1.0
    if FP8_FORMAT != 0:
        if SCALE_FROM_AMAX:
            scale = scale_from_amax(tl.load(amax_ptr), margin_factor, FP8_FORMAT)
            if writer:
                tl.store(scale_ptr, scale)
        else:
            scale = tl.load(scale_ptr)
    return scale


@triton.jit
def scale_from_amax(amax, margin_factor, FP8_FORMAT: tl.constexpr):
    """Current scaling's scale, ``scale_quotient`` of the format's largest value and ``amax``
    (``margin_factor = 2**margin``); 1 where ``amax`` is zero or not finite. ``scale_from_amax_reference``
    is its torch twin."""
    if FP8_FORMAT == 1:
        fp8_max = tl.full((), 448.0, tl.float32)
    else:
        fp8_max = tl.full((), 57344.0, tl.float32)
    usable = (amax > 0) & (amax < float("inf"))  # false for NaN too
    return tl.where(usable, scale_quotient(fp8_max, amax, usable, margin_factor), 1.0)


@triton.jit
def scale_quotient(fp8_max, amax, usable, margin_factor):
    """``fp8_max / amax / margin_factor`` where ``usable``, each division correctly rounded (bit-identical
    to PyTorch's), at most the largest finite fp32: a tiny amax overflows the quotient, and an infinite
    scale turns zeros into NaN (0 * inf). Where not ``usable`` the value is meaningless (callers replace it)."""
    quotient = tl.math.div_rn(tl.math.div_rn(fp8_max, tl.where(usable, amax, 1.0)), margin_factor)
    return tl.minimum(quotient, 3.4028234663852886e38)


def scale_from_amax_reference(amax: torch.Tensor, fp8_max: float, margin: int) -> torch.Tensor:
    """``scale_from_amax`` in torch: a 0-d fp32 tensor with the same bits."""
    usable = torch.isfinite(amax) & (amax > 0)
    quotient = torch.full_like(amax, fp8_max) / torch.where(usable, amax, torch.ones_like(amax))
    scale = (quotient / torch.full_like(amax, 2.0 ** margin)).clamp(max=torch.finfo(torch.float32).max)
    return torch.where(usable, scale, torch.ones_like(amax)).reshape(())


def quantize_reference(x: torch.Tensor, scale: torch.Tensor | float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x * scale)`` in ``fp8_dtype``, rounded to nearest-even (torch's own cast)."""
    fmt = fp8_format(fp8_dtype)
    scaled = x.to(torch.float32) * (scale.to(torch.float32) if isinstance(scale, torch.Tensor) else scale)
    return scaled.clamp(-fmt.max, fmt.max).to(fp8_dtype)
