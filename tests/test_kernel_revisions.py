"""benchmarks/kernel_revisions.py, the same-run A/B of kernel source revisions: it must load copies
of the kernel module beside the installed one, and its checks must catch a copy that writes a
wrong byte, or its timings could rank a broken kernel first. Run on CPU it checks without timing."""

import csv
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

# the module, not the function the package exports under the same name
shipped = importlib.import_module("lightning_fuse.kernels.dact_dbias_quantize")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_revisions.py"
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks alone run on CPU")


def _run(tmp_path, *sources):
    args = [arg for name, path in sources for arg in ("--source", f"{name}={path}")]
    return subprocess.run([sys.executable, str(SCRIPT), *args, "--sizes", "64x96", "--grids", "shipped,t2",
                           "--out", str(tmp_path / "out")], cwd=SCRIPT.parent, capture_output=True, text=True,
                          timeout=600)


def _mutated(tmp_path, name, old, new):
    """A copy of the shipped kernel source named ``name`` with ``old`` (which it must hold) replaced."""
    source = Path(shipped.__file__).read_text()
    assert old in source
    path = tmp_path / f"{name}.py"
    path.write_text(source.replace(old, new))
    return path


def test_two_copies_of_the_shipped_source_pass_every_check(tmp_path):
    copy = tmp_path / "copy.py"
    copy.write_text(Path(shipped.__file__).read_text())
    result = _run(tmp_path, ("shipped", shipped.__file__), ("copy", copy))
    assert result.returncode == 0, result.stderr[-2000:]
    table = result.stdout.splitlines()
    # 2 passes x 2 grids, one row per source each, all checked
    assert sum(" True" in line and ("shipped " in line or "copy " in line) for line in table) >= 8
    assert (tmp_path / "out" / "revisions.csv").exists()


def test_a_copy_with_a_wrong_transposed_byte_is_flagged(tmp_path):
    broken = _mutated(tmp_path, "broken", "words = c0 | (c1 << 8)", "words = c0 | (c0 << 8)")
    result = _run(tmp_path, ("shipped", shipped.__file__), ("broken", broken))
    assert result.returncode == 1
    assert "CHECK FAILED broken" in result.stderr


def test_a_source_that_is_not_the_kernel_module_is_refused(tmp_path):
    other = tmp_path / "other.py"
    other.write_text("x = 1\n")
    result = _run(tmp_path, ("other", other))
    assert result.returncode != 0
    assert "has no _launch; expected a copy of kernels/dact_dbias_quantize.py" in result.stderr


def test_a_first_source_that_scales_wrong_is_flagged_though_its_copies_agree(tmp_path):
    # Both copies of a wrong cast agree with each other; the float64 reference is what catches it.
    doubled = _mutated(tmp_path, "doubled", "codes = fp8_codes(x * scale, FP8_FORMAT, ENCODER)",
                       "codes = fp8_codes(x * scale * 2, FP8_FORMAT, ENCODER)")
    result = _run(tmp_path, ("doubled", doubled))
    assert result.returncode == 1
    assert "CHECK FAILED doubled" in result.stderr


def _run_public(tmp_path, source, *extra):
    args = ["--source", source, "--public", "--sizes", "64x96", "--out", str(tmp_path / "out"), *extra]
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=SCRIPT.parent, capture_output=True, text=True,
                          timeout=600)


def test_the_public_function_is_checked_and_listed_beside_the_copies(tmp_path):
    result = _run_public(tmp_path, f"shipped={shipped.__file__}", "--passes",
                         "dact_dbias_quantize,dbias_quantize,quantize", "--grids", "shipped,t1", "--scale", "8")
    assert result.returncode == 0, result.stderr[-2000:]
    with open(tmp_path / "out" / "revisions.csv") as f:
        rows = list(csv.DictReader(f))
    public = [r for r in rows if r["source"] == "public"]
    # one row per pass, in the shipped grid only (its launch is the package's own), each checked
    assert sorted(r["kernel"] for r in public) == ["dact_dbias_quantize", "dbias_quantize", "quantize"]
    assert all(r["grid"] == "shipped" and r["ok"] == "True" for r in public)
    assert all(r["ok"] == "True" for r in rows if r["source"] == "shipped")
    assert any(r["source"] == "shipped" and r["grid"] == "t1" for r in rows)


def test_a_public_result_unlike_the_first_source_is_flagged(tmp_path):
    # The public function runs the installed module: against a first source that casts at twice
    # the scale, its codes differ, and its row fails.
    doubled = _mutated(tmp_path, "doubled", "codes = fp8_codes(x * scale, FP8_FORMAT, ENCODER)",
                       "codes = fp8_codes(x * scale * 2, FP8_FORMAT, ENCODER)")
    result = _run_public(tmp_path, f"doubled={doubled}", "--passes", "dbias_quantize")
    assert result.returncode == 1
    assert "CHECK FAILED public dbias_quantize" in result.stderr


def test_the_name_public_is_refused_for_a_copy_when_public_is_asked(tmp_path):
    result = _run_public(tmp_path, f"public={shipped.__file__}")
    assert result.returncode != 0
    assert "the name 'public' is taken by --public" in result.stderr


def test_the_fused_pass_is_checked_against_the_activation_asked_for(tmp_path):
    # --activation silu: the launches and the public function run SiLU's derivative and pass the checks
    # against float64 SiLU (against tanh-GELU's reference the codes would differ); an unknown name is
    # refused by argparse with the names accepted.
    result = _run_public(tmp_path, f"shipped={shipped.__file__}", "--passes", "dact_dbias_quantize",
                         "--grids", "shipped,t1", "--activation", "silu")
    assert result.returncode == 0, result.stderr[-2000:]
    with open(tmp_path / "out" / "revisions.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and all(r["ok"] == "True" for r in rows)
    refused = _run_public(tmp_path, f"shipped={shipped.__file__}", "--activation", "swish")
    assert refused.returncode != 0
    assert "invalid choice: 'swish'" in refused.stderr and "silu" in refused.stderr


@pytest.mark.parametrize("grid", ["p3", "t2", "q3c4"])
def test_a_register_cap_in_the_tiles_reaches_the_launch_of_every_grid_kind(grid, monkeypatch):
    import torch

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    kernel_revisions = importlib.import_module("kernel_revisions")
    device = torch.device("cpu")
    capped = kernel_revisions.grid_config("dact_dbias_quantize", 256, 96, device, grid, (64, 64, 4, 0, 1, 80))
    uncapped = kernel_revisions.grid_config("dact_dbias_quantize", 256, 96, device, grid, (64, 64, 4, 0, 1))
    assert (capped.max_registers, uncapped.max_registers) == (80, 0)
    assert capped.groups == uncapped.groups  # the cap changes nothing else
