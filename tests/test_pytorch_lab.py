"""Lab 06 as its user runs it: `jaxpar lab pytorch --quick` (PyTorch TP+SP and 1F1B on 2 gloo processes beside
jaxpar's counterparts on 2 devices, 4 steps) writes its inputs and raw results, results.json and the sheet before
any figure, then both figures; the sheet holds the measured numbers. Without torch: one line and exit 2."""
import importlib.util
import json
import sys

import pytest

from jaxpar import cli, units
from jaxpar.labs.pytorch import lab

HAS_TORCH = all(importlib.util.find_spec(name) for name in ("torch", "transformers"))


@pytest.mark.slow       # 2 gloo processes, 4 jaxpar compiles: 61-66 CPU-s, 177-293 s wall at load 11-16 on 2 cores
@pytest.mark.skipif(not HAS_TORCH, reason="the optional extra torch (torch, transformers) is not installed")
def test_quick_lab_writes_raw_results_sheet_then_figures(tmp_path, monkeypatch):
    out = tmp_path / "out"
    drawn = {}

    def after_results(name, plot):                 # each figure is drawn after what it draws from is on disk
        def draw(result, path):
            drawn[name] = sorted(p.name for p in out.iterdir())
            return plot(result, path)
        return draw

    monkeypatch.setattr(lab, "PLOTS", {name: (key, after_results(name, plot)) for name, (key, plot)
                                       in lab.PLOTS.items()})
    assert cli.main(["lab", "pytorch", "--quick", "--out", str(out)]) == 0
    assert set(drawn) == {"losses.png", "bytes.png"}
    assert all({"raw", "report.md", "results.json"} <= set(files) for files in drawn.values())
    assert all((out / name).stat().st_size > 10_000 for name in drawn)
    assert {"batches.npz", "torch-rank0.json", "torch-rank1.json", "jaxpar.json"} <= {p.name for p in
                                                                                      (out / "raw").iterdir()}
    results, sheet = json.loads((out / "results.json").read_text()), (out / "report.md").read_text()
    assert (results["steps"], results["processes"], results["microbatches"]) == (4, 2, 2)
    rows = results["rows"]
    assert list(rows) == ["single", "tp-sp", "1f1b"] and [len(rows[k]) for k in rows] == [2, 3, 2]
    for key, row in ((key, r) for key, group in rows.items() for r in group):
        assert row["within"] and row["losses"][-1] < row["losses"][0]       # trained, and to the same losses
        assert f"| {row['losses'][-1]:.6f} | {row['dev_own']:.1e} |" in sheet   # the sheet prints what was measured
        assert key == "single" or units.fmt_bytes(sum(row["sent"].values())) in sheet
    ranks = [json.loads((out / "raw" / f"torch-rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["tp-sp"]["losses"] == ranks[1]["tp-sp"]["losses"]        # every rank reports the global mean
    torch_1f1b, formula = sum(rows["1f1b"][0]["sent"].values()), results["formulas"]["1f1b"][1][0]
    assert formula <= torch_1f1b <= formula + 64       # 2(p-1)/p·b·s·h·4 sent, + the loss's broadcast/all-reduce
    assert f"{results['transformers_max_abs_logit_dev']:.1e}" in sheet


def test_without_torch_one_line_names_the_cpu_wheel_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)           # `import torch` fails; find_spec finds nothing
    out = tmp_path / "out"
    assert cli.main(["lab", "pytorch", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: torch: not installed"), err
    assert f"pip install torch --index-url {lab.TORCH_CPU_INDEX}" in err and not out.exists()
