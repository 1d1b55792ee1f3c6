"""``fp8_tile_codes``'s PTX, run without a GPU: a small interpreter of the three instructions it uses
(``cvt`` to an FP8 pair, ``mov.b32`` of two halves, ``prmt``), with the conversion taken from torch's
own saturating cast. It checks the operand numbering (``$0..$3`` the row sets' codes, ``$4..$7`` the
words, ``$8 + 4 j + k`` element ``k`` of row set ``j``) and the byte transpose; the GPU tests check the
compiled kernels against the integer encoder bit for bit (tests/test_gpu.py)."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_fuse.kernels.fp8 import FP8_FORMATS, _tile_asm

KINDS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _code(value: float, fp8_dtype: torch.dtype) -> int:
    """``cvt.rn.satfinite``'s byte for ``value``: nearest-even, clamped to the finite range."""
    fmax = FP8_FORMATS[fp8_dtype].max
    clamped = torch.tensor([value], dtype=torch.float32).clamp(-fmax, fmax)
    return int(clamped.to(fp8_dtype).view(torch.uint8))


def _run_ptx(asm: str, inputs: list[float], fp8_dtype: torch.dtype) -> list[int]:
    """Runs ``asm`` with ``$8..`` bound to ``inputs``; returns the 32-bit outputs ``$0..$7``."""
    body = asm.strip()
    assert body.startswith("{") and body.endswith("}"), body
    regs: dict[str, object] = {f"${8 + i}": v for i, v in enumerate(inputs)}

    def value(operand: str) -> int:
        return int(operand, 16) if operand.startswith("0x") else int(regs[operand])

    for statement in body[1:-1].split(";"):
        statement = statement.strip()
        if not statement or statement.startswith(".reg"):
            continue
        op, rest = statement.split(None, 1)
        if op.startswith("cvt.rn.satfinite.") and op.endswith("x2.f32"):
            d, a, b = [x.strip() for x in rest.split(",")]
            assert op == f"cvt.rn.satfinite.{'e4m3' if fp8_dtype == torch.float8_e4m3fn else 'e5m2'}x2.f32", op
            regs[d] = (_code(regs[a], fp8_dtype) << 8) | _code(regs[b], fp8_dtype)  # a into the high byte
        elif op == "mov.b32":
            d, halves = rest.split(",", 1)
            lo, hi = re.fullmatch(r"\s*\{\s*(\S+)\s*,\s*(\S+)\s*\}\s*", halves).groups()
            regs[d.strip()] = value(lo) | (value(hi) << 16)
        elif op == "prmt.b32":
            d, a, b, c = [x.strip() for x in rest.split(",")]
            pool = value(a) | (value(b) << 32)
            selector = value(c)
            result = 0
            for n in range(4):
                index = (selector >> (4 * n)) & 0xF
                assert index < 8, "sign-replicating selectors are not used"
                result |= ((pool >> (8 * index)) & 0xFF) << (8 * n)
            regs[d] = result
        else:
            raise AssertionError(f"unexpected instruction {statement!r}")
    return [int(regs[f"${i}"]) for i in range(8)]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_tile_asm_gives_each_row_sets_codes_and_each_elements_word(kind):
    fp8_dtype = KINDS[kind]
    fmax = FP8_FORMATS[fp8_dtype].max
    torch.manual_seed(3)
    asm = _tile_asm(kind)
    for trial in range(20):
        # mixed magnitudes, saturating values, zeros and negative zeros, subnormals
        x = (torch.randn(4, 4) * torch.logspace(-9, 3, 16).reshape(4, 4)[torch.randperm(4)]).tolist()
        if trial == 0:
            x[0] = [0.0, -0.0, 2 * fmax, -3 * fmax]
        inputs = [x[j][k] for j in range(4) for k in range(4)]
        out = _run_ptx(asm, inputs, fp8_dtype)
        codes = [[_code(x[j][k], fp8_dtype) for k in range(4)] for j in range(4)]
        for j in range(4):  # $j: row set j's codes, element k in byte k
            assert out[j] == sum(codes[j][k] << (8 * k) for k in range(4)), (trial, j)
        for k in range(4):  # $(4 + k): element k's word, row set j in byte j
            assert out[4 + k] == sum(codes[j][k] << (8 * j) for j in range(4)), (trial, k)


def test_the_interpreter_above_catches_a_swapped_selector():
    # The check is not vacuous: the same asm with two rows' selectors swapped fails it.
    asm = _tile_asm("e5m2").replace("prmt.b32 $0, s0, s2, 0x5410", "prmt.b32 $0, s0, s2, 0x7632")
    inputs = [float(v) for v in range(1, 17)]
    out = _run_ptx(asm, inputs, torch.float8_e5m2)
    row0 = sum(_code(float(1 + k), torch.float8_e5m2) << (8 * k) for k in range(4))
    assert out[0] != row0
