"""The kernels' compiled code, checked without a GPU: benchmarks/kernel_isa.py compiles each pass for
sm_90 with the toolchain Triton bundles and reads the SASS of its row loop. Near the copy bandwidth
the fused kernel is bound by instruction issue (BENCHMARKS.md, "Instruction budget"), so more
instructions per element are a slowdown this test sees before a GPU does; so are narrow stores of
the packed transposed copy, which once made every pass 2-3.4 times slower."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_isa.py"


@pytest.fixture(scope="module")
def isa_rows(tmp_path_factory):
    """kernel_isa.py's row for every pass, compiled once for the tests below."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path_factory.mktemp("isa") / "isa.json"
    subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], env=env, check=True, capture_output=True,
                   text=True, timeout=900)
    return {row["kernel"]: row for row in json.loads(out.read_text())}


@pytest.mark.slow
def test_fused_gelu_tanh_backward_stays_within_its_instruction_budget(isa_rows):
    fused = isa_rows["dact_dbias_quantize gelu_tanh"]
    # 25.2 SASS instructions per element in the prefetching loop (26.8 in the 3-deep pipelined one,
    # 30.8 before the sigmoid's reciprocal was one instruction, 31.6 before the four interleaved row
    # sets per tile, 40.6 before the constants were folded and the amax's NaN check became one
    # instruction); 3 programs of 4 warps per SM, the residency the launch rule's whole waves are
    # sized for, and 5 for the forward activation.
    assert fused["loop_sass_per_element"] <= 28
    assert fused["programs_per_sm"] >= 3
    assert isa_rows["bias_act gelu_tanh"]["loop_sass_per_element"] <= 27
    assert isa_rows["bias_act gelu_tanh"]["programs_per_sm"] >= 5
    # The cast's prefetching loop (55 registers at 8 warps) at the 4 programs per SM its rule assumes.
    assert isa_rows["quantize"]["programs_per_sm"] >= 4
    # The bias gradient's 128 x 64 tiles of 8 warps at the 2 programs per SM its rule assumes.
    assert isa_rows["dbias_quantize"]["programs_per_sm"] >= 2
    # The erf GELU through a polynomial fit of erfc sharing the derivative's exponential, not
    # libdevice's erf: 32.7 and 35.9 per element, against 52.0 and 51.5 before (the forward pass at
    # 64 registers, 4 programs per SM, against 48 and 5).
    assert isa_rows["dact_dbias_quantize gelu"]["loop_sass_per_element"] <= 34
    assert isa_rows["dact_dbias_quantize gelu"]["programs_per_sm"] >= 3
    assert isa_rows["bias_act gelu"]["loop_sass_per_element"] <= 37
    assert isa_rows["bias_act gelu"]["programs_per_sm"] >= 4
    # The launch rule's second form (kernels/_launch.py) is only worth launching at 4 programs per SM.
    two_deep = isa_rows["dact_dbias_quantize gelu_tanh, 2-deep form"]
    assert two_deep["loop_sass_per_element"] <= 28
    assert two_deep["programs_per_sm"] >= 4
    # The queued form's tile loop is the row groups' (26.2 per element) at their residency: one program
    # per slot, 3 per SM, is what its grid launches (a first version compiled to 249 registers, 2 per SM).
    queued = isa_rows["dact_dbias_quantize gelu_tanh, queued"]
    assert queued["loop_sass_per_element"] <= 28
    assert queued["programs_per_sm"] >= 3


@pytest.mark.slow
def test_the_packed_transposed_copy_is_stored_16_bytes_at_a_time(isa_rows):
    # The transposed copy is written as 32-bit words (four rows of one column). When the compiler
    # could not see that a thread's words are contiguous it stored them one by one, each warp
    # instruction writing a quarter of every 32-byte sector it touched, and every pass ran 2-3.4
    # times slower on the H200 (BENCHMARKS.md). Each thread's words must go out as 16-byte stores.
    packed = [row for name, row in isa_rows.items() if not name.startswith("bias_act")]
    assert len(packed) >= 6
    for row in packed:
        block_m, block_n = map(int, row["block"].split("x"))
        words_per_thread = block_m * block_n // 4 // (32 * row["warps"])
        assert row["loop_stores"].get("STG.E.128", 0) * 4 >= words_per_thread, row


@pytest.mark.slow
def test_only_the_bias_gradient_arrival_fences(isa_rows):
    # The amax's atomic max is relaxed: its value is read after the kernel ends, so it needs no
    # fence, and a fence at the end of every program waits for that program's last stores to land.
    # The backward passes keep the one fence that orders their bias-gradient partial before their
    # arrival on the strip's counter.
    for name, row in isa_rows.items():
        expected = 0 if name.startswith(("quantize", "bias_act")) else 1
        assert row["fences"] == expected, (name, row["fences"])


def _sass(*lines):
    """SASS text as cuobjdump prints it: ``(opcode, operands)`` at addresses 0x0000, 0x0010, ..."""
    return "\n".join(f"        /*{16 * i:04x}*/                   {op} {operands} ;" for i, (op, operands) in
                     enumerate(lines))


def test_the_loop_counted_is_the_row_loop_less_its_once_only_block():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from kernel_isa import loop_body
    finally:
        sys.path.remove(str(SCRIPT.parent))
    straight = _sass(("MOV", "R0, R1"), ("FADD", "R2, R2, R3"), ("FMUL", "R4, R2, R2"), ("@P0 BRA", "0x10"),
                     ("EXIT", ""))
    assert loop_body(straight) == ["FADD", "FMUL", "BRA"]
    # A row loop (0x10-0x90) holding a block run on the last tile only (skipped by the branch at 0x30,
    # itself a loop summing partials, 0x40-0x60): one iteration is the rest.
    nested = _sass(("MOV", "R0, R1"), ("FADD", "R2, R2, R3"), ("FMUL", "R4, R2, R2"), ("@!P1 BRA", "0x80"),
                   ("LDG.E", "R5, [R6]"), ("FADD", "R7, R7, R5"), ("@P2 BRA", "0x40"), ("STG.E", "[R8], R7"),
                   ("F2FP.BF16", "R9, R4"), ("@P0 BRA", "0x10"), ("EXIT", ""))
    assert loop_body(nested) == ["FADD", "FMUL", "BRA", "F2FP.BF16", "BRA"]
    # A forward branch over a block without a loop (a masked tail, say) is part of the iteration.
    guarded = _sass(("MOV", "R0, R1"), ("FADD", "R2, R2, R3"), ("@!P1 BRA", "0x40"), ("STG.E", "[R8], R2"),
                    ("@P0 BRA", "0x10"), ("EXIT", ""))
    assert loop_body(guarded) == ["FADD", "BRA", "STG.E", "BRA"]
    with pytest.raises(ValueError, match="no loop"):
        loop_body(_sass(("MOV", "R0, R1"), ("EXIT", "")))
    # The queued form: a loop over chunks (0x10-0x70) around the tile loop (0x20-0x40, the one that
    # converts to FP8); the innermost count is the tile loop alone.
    queued = _sass(("MOV", "R0, R1"), ("IADD3", "R1, R1, 1"), ("FMUL", "R4, R2, R2"), ("F2FP.SATFINITE", "R9, R4"),
                   ("@P0 BRA", "0x20"), ("STG.E", "[R8], R7"), ("ATOMG.E.ADD", "R5, [R6], R1"), ("@P1 BRA", "0x10"),
                   ("EXIT", ""))
    assert loop_body(queued, innermost=True) == ["FMUL", "F2FP.SATFINITE", "BRA"]
    assert loop_body(queued) == ["IADD3", "FMUL", "F2FP.SATFINITE", "BRA", "STG.E", "ATOMG.E.ADD", "BRA"]
    # A queued pass that stores nothing (current scaling's first) converts nothing: its tile loop
    # (0x10-0x30) is the one that loads tiles 16 bytes a thread, not the shorter one (0x40-0x50) that
    # sums the bias gradient's partials.
    no_stores = _sass(("MOV", "R0, R1"), ("LDG.E.128", "R4, [R2]"), ("FMUL", "R4, R4, R4"), ("@P0 BRA", "0x10"),
                      ("LDG.E.STRONG.GPU", "R5, [R6]"), ("@P2 BRA", "0x40"), ("@P1 BRA", "0x10"), ("EXIT", ""))
    assert loop_body(no_stores, innermost=True) == ["LDG.E.128", "FMUL", "BRA"]


def _probe(source: str) -> dict:
    """Runs ``source`` (a script that compiles builds through kernel_isa.py, whose folder it gets as its
    argument) outside the interpreter, and returns the JSON object its last line prints."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", source, str(SCRIPT.parent)], env=env, check=True,
                          capture_output=True, text=True, timeout=1800)
    return json.loads(done.stdout.strip().splitlines()[-1])


_CONTRACTION_PROBE = r"""
import collections, json, re, sys
sys.path.insert(0, sys.argv[1])
from kernel_isa import CASES, compile_for_sm90, sass_and_registers
counts = {}
for name in ("dact_dbias_quantize gelu_tanh", "dact_dbias_quantize silu", "dact_dbias_quantize gelu_tanh, queued"):
    kernel, names, types, unit_strides, constants, warps, _ = CASES[name]
    for dbias, finish in ((True, True), (True, False), (False, False)):
        c = dict(constants, COMPUTE_DBIAS=dbias, FINISH_DBIAS=finish)
        sass, _ = sass_and_registers(compile_for_sm90(kernel, names, types, unit_strides, c, warps).asm["ptx"])
        counts[f"{name} dbias={dbias} finish={finish}"] = len(re.findall(r"\bFFMA\b", sass))
print(json.dumps(counts))
"""


@pytest.mark.slow
def test_the_bias_gradient_sums_the_products_the_fp8_copy_is_made_of():
    # ptxas may fuse a product into an addition that uses it, and whether it does depended on the code
    # around: the pass's build that sums the bias gradient itself and the one whose sum a second launch
    # does (eager and torch.compile) gave partials that differed in 468 of 1,200 entries on an H100. The
    # bias gradient's additions are not fusable: a build with the bias gradient has exactly the fused
    # multiply-adds of one without.
    counts = _probe(_CONTRACTION_PROBE)
    for name in ("dact_dbias_quantize gelu_tanh", "dact_dbias_quantize silu", "dact_dbias_quantize gelu_tanh, queued"):
        without = counts[f"{name} dbias=False finish=False"]
        assert without > 0
        assert counts[f"{name} dbias=True finish=True"] == without, counts
        assert counts[f"{name} dbias=True finish=False"] == without, counts


_LOAD_WAIT_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from kernel_isa import CASES, _bias_act_case, _dact_case, _queued_case, analyse, with_inputs
from lightning_fuse.kernels.activations import ACTIVATIONS
waits = {}
for dtype in ("bf16", "fp16"):
    for act, name in enumerate(ACTIVATIONS, 1):
        for form, case in (("queued", _queued_case(act)), ("row groups", _dact_case("dact_dbias_quantize", act, 6)),
                           ("forward", _bias_act_case(act))):
            waits[f"{name} {dtype} {form}"] = analyse(name, with_inputs(case, dtype), 4249.0, 132, 1.98)["load_wait"]
    for name in ("dbias_quantize", "quantize"):
        waits[f"{name} {dtype}"] = analyse(name, with_inputs(CASES[name], dtype), 4249.0, 132, 1.98)["load_wait"]
print(json.dumps(waits))
"""


@pytest.mark.slow
def test_the_passes_wait_on_their_prefetched_tile_late_in_the_iteration():
    # Each iteration loads the next tile while it computes this one. ptxas has six scoreboards; where
    # it ran out it gave two of the next tile's loads the scoreboard of an exp issued beside them, and
    # waited on them a dozen instructions later with the exp's result: the queued form with fp16
    # tanh-GELU and with bf16 and fp16 SiLU and quick-GELU, and the row groups with fp16 quick-GELU, ran
    # 12-20% slower on an H100 and an H200 (BENCHMARKS.md).
    # Every activation's prefetching loops, bf16 and fp16 inputs, the queued form and the row groups:
    # no load waited on fewer than 100 instructions after it is issued (they are now 259-304); nor in
    # the forward activation's (124-186, in loops of about 200), the cast's or the bias gradient's.
    # One exception, timed: the queued form with bf16 quick-GELU, built as bf16 launches build it (the
    # bias gradient rounded to bf16 inside the loop over chunks), waits on a load 18 instructions after
    # it. Four orders of its loads in the source left an early wait (12-22 instructions); on the H100s
    # that take the queued form it is still 5-8% faster than the row groups (BENCHMARKS.md).
    waits = _probe(_LOAD_WAIT_PROBE)
    assert len(waits) == 40
    early = {name: wait for name, wait in waits.items() if wait is None or wait < 100}
    assert set(early) <= {"quick_gelu bf16 queued"}, early


def _sass_with_control(*lines):
    """``_sass`` with each instruction's encoding as cuobjdump prints it: ``(opcode, operands, write
    scoreboard or None, scoreboards waited on)``."""
    out = []
    for i, (op, operands, board, waits) in enumerate(lines):
        control = (7 if board is None else board) << 5 | 7 << 8 | sum(1 << b for b in waits) << 11
        out.append(f"        /*{16 * i:04x}*/                   {op} {operands} ;    /* 0x000000000000000{i % 10} */")
        out.append(f"                                                        /* 0x{control << 41:016x} */")
    return "\n".join(out)


def test_load_wait_counts_to_the_first_wait_on_the_load_s_scoreboard_round_the_loop():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from kernel_isa import load_wait, loop_body
    finally:
        sys.path.remove(str(SCRIPT.parent))
    # A loop (0x10-0x60): a load on scoreboard 3, an exp on scoreboard 2, a use of the exp (waits on 2),
    # a store, then the loop's end waits on 3: four instructions from the load.
    late = _sass_with_control(("MOV", "R0, R1", None, ()), ("LDG.E.128", "R4, [R2]", 3, ()),
                              ("MUFU.EX2", "R8, R9", 2, ()), ("FADD", "R8, R8, 1", None, (2,)),
                              ("STG.E", "[R6], R8", None, ()), ("IMAD.MOV", "R10, RZ, RZ, R4", None, (3,)),
                              ("@P0 BRA", "0x10", None, ()), ("EXIT", "", None, ()))
    assert loop_body(late) == ["LDG.E.128", "MUFU.EX2", "FADD", "STG.E", "IMAD.MOV", "BRA"]
    assert load_wait(late) == 4
    # The exp given the load's scoreboard: the use of the exp waits on the load two instructions on.
    shared = _sass_with_control(("MOV", "R0, R1", None, ()), ("LDG.E.128", "R4, [R2]", 3, ()),
                                ("MUFU.EX2", "R8, R9", 3, ()), ("FADD", "R8, R8, 1", None, (3,)),
                                ("STG.E", "[R6], R8", None, ()), ("IMAD.MOV", "R10, RZ, RZ, R4", None, (3,)),
                                ("@P0 BRA", "0x10", None, ()), ("EXIT", "", None, ()))
    assert load_wait(shared) == 2
    # Waited on only in the next iteration, before the load comes round again: counted round the loop.
    wrapped = _sass_with_control(("MOV", "R0, R1", None, ()), ("FADD", "R10, R4, 1", None, (3,)),
                                 ("FMUL", "R11, R10, R10", None, ()), ("LDG.E.128", "R4, [R2]", 3, ()),
                                 ("STG.E", "[R6], R11", None, ()), ("@P0 BRA", "0x10", None, ()),
                                 ("EXIT", "", None, ()))
    assert load_wait(wrapped) == 3
    # No encodings in the text, or no global load in the loop: nothing to count.
    assert load_wait(_sass(("MOV", "R0, R1"), ("LDG.E", "R4, [R2]"), ("@P0 BRA", "0x10"), ("EXIT", ""))) is None
    no_load = _sass_with_control(("MOV", "R0, R1", None, ()), ("FADD", "R8, R8, 1", None, ()),
                                 ("@P0 BRA", "0x10", None, ()), ("EXIT", "", None, ()))
    assert load_wait(no_load) is None


_TILE_ENCODER_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from kernel_isa import CASES, analyse, with_encoder
rows = {}
for name in ("dact_dbias_quantize gelu_tanh", "dact_dbias_quantize gelu_tanh, 2-deep form",
             "dact_dbias_quantize gelu_tanh, queued", "dbias_quantize", "quantize"):
    for encoder in ("ptx", "tile"):
        rows[f"{name} {encoder}"] = analyse(name, with_encoder(CASES[name], encoder), 4249.0, 132, 1.98)
print(json.dumps(rows))
"""


@pytest.mark.slow
def test_the_tile_encoder_converts_both_layouts_in_fewer_instructions():
    # LIGHTNING_FUSE_FP8_ENCODER=tile (kernels/_launch.py): a tile's FP8 codes converted two at a time
    # and byte-transposed in registers (fp8.py's fp8_tile_codes) instead of one conversion, a mask and
    # the packing of each layout per value: 25.5 -> 23.2 per element in the fused pass's prefetching
    # loop, 25.9 -> 22.3 in its two-deep form (with the bf16 inputs widened in two instructions a pair),
    # 11.5 -> 8.8 in the bias gradient's, 13.1 -> 10.2 in the cast's. The queued form keeps the
    # per-value conversion (there the packed one gave a load an exp's scoreboard: BENCHMARKS.md).
    rows = _probe(_TILE_ENCODER_PROBE)
    for name, saved in (("dact_dbias_quantize gelu_tanh", 2.0), ("dact_dbias_quantize gelu_tanh, 2-deep form", 3.0),
                        ("dbias_quantize", 2.5), ("quantize", 2.5)):
        ptx, tile = rows[f"{name} ptx"], rows[f"{name} tile"]
        assert tile["loop_sass_per_element"] <= ptx["loop_sass_per_element"] - saved, (name, ptx, tile)
        assert tile["programs_per_sm"] >= ptx["programs_per_sm"], (name, ptx, tile)
        assert tile["loop_stores"].get("STG.E.128", 0) == ptx["loop_stores"].get("STG.E.128", 0), (name, ptx, tile)
    queued = "dact_dbias_quantize gelu_tanh, queued"
    assert rows[f"{queued} tile"]["loop_sass_per_element"] == rows[f"{queued} ptx"]["loop_sass_per_element"]
