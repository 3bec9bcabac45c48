"""benchmarks/bias_grad.py on a CPU: every way of the column sum gives the float64 sum within bf16 rounding."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import bias_grad  # noqa: E402


def test_every_way_is_the_column_sum(tmp_path):
    out = tmp_path / "bias_grad.json"
    assert bias_grad.main(["--device", "cpu", "--iters", "1", "--shapes", "64x8,300x12", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["rows"], r["columns"], r["way"]) for r in rows} == {
        (m, n, way) for m, n in ((64, 8), (300, 12)) for way in ("sum", "mv", "mm")}
    assert all(r["relative_error"] < 2e-2 and r["ms"] >= 0 and r["scratch_bytes"] is None for r in rows)
