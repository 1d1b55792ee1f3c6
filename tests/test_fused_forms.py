"""benchmarks/fused_forms.py, the fused pass's forms beside the same-run baselines: each form must run
what it names (the kernel copy it loads, the row order it asks for), and a form that writes a wrong
byte must be flagged before its timing is listed. Run on CPU it checks without timing."""

import csv
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

# the module, not the function the package exports under the same name
shipped = importlib.import_module("lightning_fuse.kernels.dact_dbias_quantize")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fused_forms.py"
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks alone run on CPU")


def _run(tmp_path, *forms):
    args = [arg for form in forms for arg in ("--form", form)]
    return subprocess.run([sys.executable, str(SCRIPT), *args, "--sizes", "132x96", "--dtypes", "bf16",
                           "--out", str(tmp_path / "out")], cwd=SCRIPT.parent, capture_output=True, text=True,
                          timeout=600)


def test_each_form_is_checked_and_runs_the_row_order_it_names(tmp_path):
    copy = tmp_path / "copy.py"
    copy.write_text(Path(shipped.__file__).read_text())
    result = _run(tmp_path, "shipped", "in_turn", f"copy={copy}+in_turn")
    assert result.returncode == 0, result.stderr[-2000:]
    with open(tmp_path / "out" / "fused_forms.csv") as f:
        rows = {row["form"]: row for row in csv.DictReader(f)}
    assert set(rows) == {"shipped", "in_turn", "copy+in_turn"}
    assert all(row["ok"] == "True" for row in rows.values())
    assert [rows[name]["in_turn"] for name in ("shipped", "in_turn", "copy+in_turn")] == ["False", "True", "True"]
    assert int(rows["shipped"]["groups"]) >= 2  # else dealing tiles in turn would change nothing


def test_the_register_cap_and_group_count_forms_run_the_grid_they_name(tmp_path):
    # 132 rows are 9 row tiles in the interpreter's 16-row tiles: 4 groups take 3 tiles each, which
    # leaves the fourth empty, so the count is evened out to 3 groups as the rules do.
    result = _run(tmp_path, "shipped", "regs96+groups4", "groups9")
    assert result.returncode == 0, result.stderr[-2000:]
    with open(tmp_path / "out" / "fused_forms.csv") as f:
        rows = {row["form"]: row for row in csv.DictReader(f)}
    assert all(row["ok"] == "True" for row in rows.values())
    assert (rows["regs96+groups4"]["groups"], rows["regs96+groups4"]["max_registers"]) == ("3", "96")
    assert (rows["groups9"]["groups"], rows["groups9"]["max_registers"]) == ("9", "0")
    assert rows["shipped"]["groups"] not in ("3", "9")


def test_a_copy_with_a_wrong_transposed_byte_is_flagged(tmp_path):
    source = Path(shipped.__file__).read_text()
    old = "words = c0 | (c1 << 8)"
    assert old in source
    broken = tmp_path / "broken.py"
    broken.write_text(source.replace(old, "words = c0 | (c0 << 8)"))
    result = _run(tmp_path, "shipped", f"broken={broken}")
    assert result.returncode == 1
    assert "CHECK FAILED broken 132x96 bf16" in result.stdout
    assert "CHECK FAILED shipped" not in result.stdout


@pytest.mark.parametrize("form", ["stages0", "in-turn", "shipped+fast", "regs8", "groups0"])
def test_a_form_it_does_not_know_is_refused_by_name(tmp_path, form):
    result = _run(tmp_path, form)
    assert result.returncode != 0
    assert f"--form {form!r}" in result.stderr
    assert "expected shipped, stagesK (K >= 1), in_turn, regsR (R >= 24), groupsG (G >= 1) or NAME=PATH" in result.stderr
