"""What each lab's quick run must show, read from its results.json (tests/test_journeys.py::test_lab_quick).

A lab whose quick journey runs in CI is checked here rather than by a second in-suite run of the same lab: the
numbers its sheet relies on hold at the quick size too. A lab without an entry is checked for its files only.
"""
import pytest


def zero(r: dict, report: str) -> None:
    """Lab 02: every strategy matches one device; the manual stages' state and bytes match the formulas."""
    assert "Total lab time" in report
    runs = r["equivalence"]["runs"]
    assert set(runs) == {"single", "auto-data", "auto-fsdp", "ddp", "zero1", "zero2", "zero3"}
    assert all(run["within_tolerance"] for run in runs.values()), {k: v["max_rel_dev"] for k, v in runs.items()}

    mem = r["memory"]["rows"]
    assert all(row["arguments_check"] for row in mem.values())   # input shardings + batch = memory_analysis
    gradient = r["memory"]["gradient"]                           # ZeRO-2 never holds the whole gradient
    assert gradient["layers"] == 8 and gradient["measured_drop"] > 0.5 * gradient["full_gradient"]
    for key in ("ddp", "zero1", "zero2", "zero3"):               # manual stages: the formula to the byte
        assert mem[key]["compiled_state"]["params"] == pytest.approx(mem[key]["formula"]["params"])
        assert mem[key]["compiled_state"]["optimizer"] == pytest.approx(mem[key]["formula"]["optimizer"])

    comm = r["communication"]["rows"]
    for key in ("auto-data", "ddp", "zero1", "zero2", "zero3", "auto-fsdp"):
        assert comm[key]["compiled_bytes"] == pytest.approx(comm[key]["written_bytes"], rel=0.01), key
    assert comm["ddp"]["compiled_bytes"] == pytest.approx(comm["ddp"]["course_bytes"], rel=1e-3)
    xla = r["communication"]["xla_auto_fsdp"]
    assert xla["then_sliced"] > 0 and xla["reduce_scatter_instructions"] == 0   # XLA:CPU: all-reduce + slice

    assert set(r["remat"]["rows"]) == {"none", "full", "dots", "names"}
    assert r["remat"]["rows"]["full"]["temp"] < r["remat"]["rows"]["none"]["temp"]
    prec = r["precision"]["runs"]
    assert set(prec) == {"float32", "bfloat16"}                  # --quick's precisions
    assert all(len(p["losses"]) == r["precision"]["steps"] for p in prec.values())


def tensor(r: dict, report: str) -> None:
    """Lab 03 (tensor): manual TP and TP+SP match one device and send the bytes the formulas say; SP keeps ~1/t of
    the sequence region; the layouts part trains its MoE layout to one device's losses."""
    assert "Total lab time" in report
    runs = r["equivalence"]["runs"]
    assert {"single", "auto", "tp", "sp", "sp-keep"} <= set(runs)
    assert all(run["within_tolerance"] for run in runs.values()), {k: v["max_rel_dev"] for k, v in runs.items()}
    for key in ("tp", "sp", "sp-keep"):                          # the manual variants: the formula to the byte
        row = r["communication"]["rows"][key]
        assert row["layer_bytes"] == row["layer_predicted"] and row["step_bytes"] == row["step_predicted"], key
    sp = r["memory"]["rows"]["sp"]
    assert sp["saved_consistent"] and sp["sequence_ratio_compiled"] == pytest.approx(1 / r["tensor"], rel=0.05)
    cases = r["layouts"]["cases"]
    assert cases and all(c["max_rel_loss"] <= 1e-4 for c in cases.values()), cases


CHECKS = {"zero": zero, "tensor": tensor}
