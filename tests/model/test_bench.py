"""`hearth bench` runs the real engine benchmark and prints its table (numbers are not judged:
only that every figure was measured; timing never decides a test)."""

from __future__ import annotations

import math

from hearth.bench.engine_bench import BenchRow, format_table
from hearth.cli import main


def test_hearth_bench_prints_a_row_per_figure(capsys) -> None:
    assert main(["bench", "--prefill-tokens", "64", "--new-tokens", "4", "--batches", "1,3",
                 "--compare", "none"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["metric", "hearth"]
    metrics = {line.rsplit(None, 1)[0]: float(line.rsplit(None, 1)[1]) for line in lines[1:]}
    assert list(metrics) == ["cold start (s)", "prefill 64 tok/s", "decode b=1 tok/s",
                             "decode b=3 tok/s"]
    assert all(math.isfinite(v) and v > 0 for v in metrics.values())


def test_table_with_a_comparison_has_ratios() -> None:
    rows = [BenchRow("cold start (s)", 2.0, 8.0), BenchRow("decode b=1 tok/s", 30.0, 10.0),
            BenchRow("decode b=8 tok/s", 50.0)]
    table = format_table(rows).splitlines()
    assert table[0].split() == ["metric", "hearth", "transformers", "ratio"]
    assert table[1].split()[-1] == "4.00x" and table[2].split()[-1] == "3.00x"
    assert table[3].split()[-2:] == ["-", "-"]
