"""The labs' figures read without the report: overlapping loss curves are named, the oracle is defined, byte
axes use the unit of the lab's tables, a missing prediction says why, and no text is too small for a README.
(Known numbers in, the drawn figure's artists read back; the labs' smoke tests draw every figure of a real run.)"""
import json

import numpy as np
import pytest

from jaxpar import units
from jaxpar.labs.base import report
from jaxpar.labs.replot import main as replot
from jaxpar.labs.tensor import plots as tensor_plots
from jaxpar.labs.zero import lab as lab_zero

MIB = 2**20


def texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text")) if t.get_text()]


def smallest_font(fig) -> float:
    return min(t.get_fontsize() for t in fig.findobj(lambda a: hasattr(a, "get_fontsize") and hasattr(a, "get_text"))
               if t.get_text())


def test_equivalence_plot_names_overlapping_runs_and_defines_the_oracle(tmp_path):
    oracle = [6.0, 5.5, 5.0, 4.6]
    same = [x * (1 + 1e-7) for x in oracle]
    runs = [("single device", oracle, None), ("ddp", same, "single device"), ("zero1", same, "single device"),
            ("zero3", oracle, "single device"), ("broken", [6.0, 5.9, 5.8, 5.7], "single device")]
    fig = report.plot_equivalence(tmp_path / "eq.png", runs, 1e-4)
    assert (tmp_path / "eq.png").stat().st_size > 0
    loss, dev = fig.axes[:2]
    assert len(loss.get_lines()) == 2                                  # the oracle and the visibly different run
    left = " ".join(t.get_text() for t in loss.get_legend().get_texts()).replace("\n", " ")
    assert "single device = the oracle; overlapping it: ddp, zero1, zero3" in left and "broken" in left
    right = [t.get_text().replace("\n", " ") for t in dev.get_legend().get_texts()]
    assert "ddp, zero1 (overlapping)" in right                         # the same deviations: one line, marked
    assert "zero3" in right and "broken" in right and "tolerance 1e-4 (pass bound)" in right
    zero3 = next(line for line in dev.get_lines() if line.get_label() == "zero3")
    assert np.all(zero3.get_ydata() == 0) and dev.get_ylim()[0] == 0   # an exact 0 is drawn at 0 (symlog)
    assert "oracle is the single-device run" in fig._suptitle.get_text()
    assert smallest_font(fig) >= 10


def tensor_result(scale: float) -> dict:
    """Lab 03's part b for the default model (u = 768 KiB): MiB in its table."""
    u = 0.75 * MIB * scale
    rows = {"auto": {"label": "auto TP", "layer_by_op": {"all-reduce": 14 * u}, "layer_bytes": 14 * u,
                     "layer_predicted": 14 * u},
            "auto-sp": {"label": "auto TP, rules length=tensor",
                        "layer_by_op": {"all-gather": 6 * u, "all-reduce": 14 * u},
                        "layer_bytes": 20 * u, "layer_predicted": None},
            "tp": {"label": "manual TP", "layer_by_op": {"all-reduce": 8 * u}, "layer_bytes": 8 * u,
                   "layer_predicted": 8 * u}}
    return {"u": u, "rows": rows}


@pytest.mark.parametrize("scale, unit", [(1.0, "MiB"), (1 / 512, "KiB")])
def test_byte_axes_use_the_unit_of_the_tables(tmp_path, scale, unit):
    result = tensor_result(scale)
    assert units.fmt_bytes(result["rows"]["auto"]["layer_bytes"]).endswith(unit)      # what the table prints
    fig = tensor_plots.plot_communication(result, tmp_path / "communication.png")
    ax = fig.axes[0]
    assert ax.get_ylabel() == f"{unit} sent per device per layer"
    tallest = max(bar.get_y() + bar.get_height() for bar in ax.patches)
    assert tallest == pytest.approx(result["rows"]["auto-sp"]["layer_bytes"] / {"MiB": MIB, "KiB": 1024}[unit])
    assert "no formula: XLA's own layout" in " ".join(texts(fig))       # the bar without a prediction says why
    assert {"14u", "8u"} <= set(texts(fig))
    assert smallest_font(fig) >= 10


def test_tensor_memory_plot_is_readable(tmp_path):
    region = {"sequence_region": 6 * MIB, "tensor_region": 6.8 * MIB, "per_layer": 12.8 * MIB}
    rows = {key: {"label": label, "compiled_per_layer": 12.81 * MIB, "compiled_sequence_region": 6.01 * MIB,
                  "saved": region, "jaxpar_formula": region,
                  "korthikanti_bf16": {k: v / 2.4 for k, v in region.items()}}
            for key, label in (("tp", "manual TP"), ("sp", "manual TP+SP"))}
    fig = tensor_plots.plot_memory({"rows": rows}, tmp_path / "memory.png")
    assert fig.axes[0].get_ylabel() == "MiB per layer per device"
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "compiled (temp slope)" in legend and any("sequence region" in t for t in legend)
    assert smallest_font(fig) >= 10


def test_replot_redraws_a_run_from_its_results(tmp_path, capsys):
    oracle = [6.0, 5.0]
    runs = {"single": {"label": "single device", "losses": oracle}, "ddp": {"label": "manual DDP", "losses": oracle}}
    (tmp_path / "results.json").write_text(json.dumps({"equivalence": {"tolerance": 1e-4, "runs": runs}}))
    assert replot(["zero", str(tmp_path)]) == 0
    assert (tmp_path / "equivalence.png").stat().st_size > 0 and not (tmp_path / "memory.png").exists()
    assert replot(["nope", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("error: lab: unknown 'nope'; valid: zero, tensor, pipeline, moe, "
                                               "kernels, pytorch")
    assert set(lab_zero.PLOTS) == {"equivalence.png", "memory.png", "communication.png", "remat.png", "precision.png"}


def test_a_failing_figure_keeps_the_others_and_is_one_line(tmp_path, monkeypatch, capsys):
    """base.results.draw_plots, every lab's last step (after results.json): a plot that raises does not stop the
    others, and the failure is one line that says where the results are and how to draw them again."""
    def broken(result, path):
        raise ValueError("figure width 11 in:\n at most 10")

    runs = {"single": {"label": "single device", "losses": [6.0, 5.0]}}
    (tmp_path / "results.json").write_text(json.dumps({"equivalence": {"tolerance": 1e-4, "runs": runs}}))
    monkeypatch.setattr(lab_zero, "PLOTS", {"broken.png": (None, broken), **lab_zero.PLOTS})
    assert replot(["zero", str(tmp_path)]) == 1
    assert (tmp_path / "equivalence.png").stat().st_size > 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: drawing broken.png (ValueError: figure width 11 in: at "
                                                   "most 10) failed; results.json and report.md are in "), err
    assert f"python -m jaxpar.labs.replot zero {tmp_path}" in err
