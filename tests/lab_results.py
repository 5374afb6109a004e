"""What each lab's quick run must show, read from its results.json and the files beside it in --out
(tests/test_journeys.py::test_lab_quick).

A lab whose quick journey runs in CI is checked here rather than by a second in-suite run of the same lab: the
numbers its sheet relies on hold at the quick size too, recomputed from the measured ones where the lab records
them (losses, bytes), not read from its own verdicts. A lab without an entry is checked for its files only.
"""
import json
from pathlib import Path

import pytest


def max_rel_dev(got, want) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def zero(r: dict, report: str, out: Path) -> None:
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


def tensor(r: dict, report: str, out: Path) -> None:
    """Lab 03 (tensor): manual TP and TP+SP match one device and send the bytes the formulas say; SP keeps ~1/t of
    the sequence region; the layouts part trains its MoE layout to one device's losses; ring and all_to_all context
    parallelism over 4 devices match one device and send the predicted bytes."""
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
    context = r["context"]["runs"]                               # part e (tests/test_context.py: with fsdp, tensor)
    assert {c["impl"] for c in context.values()} == {"ring", "all_to_all"} and r["context"]["context"] == 4
    for key, c in context.items():                               # exact, and the bytes parallel/context_predict.py says
        assert c["deviation"] <= 1e-5 and c["measured"] == pytest.approx(c["predicted"], rel=0.01), (key, c)


PYTORCH_TOLERANCE = 1e-4          # experiments/06_pytorch/README.md: "Losses (...; tolerance 1e-4)"


def pytorch(r: dict, report: str, out: Path) -> None:
    """Lab 06 (--quick: TP+SP and 1F1B on 2 gloo processes beside jaxpar's on 2 devices, 4 steps): every run trains
    to both one-device runs' losses and its pair's PyTorch run's within the sheet's tolerance, every PyTorch rank
    reports the same losses, PyTorch sends its code's formula on gloo, jaxpar's 1F1B permutes PyTorch's bytes; the
    sheet prints what was measured, and the figures come after results.json (a failed plot loses nothing)."""
    assert "Total lab time" in report and f"within {PYTORCH_TOLERANCE:g}" in report
    assert (r["steps"], r["processes"], r["microbatches"]) == (4, 2, 2)
    rows = r["rows"]
    assert list(rows) == ["single", "tp-sp", "1f1b"] and [len(rows[k]) for k in rows] == [2, 3, 2]
    oracles = [row["losses"] for row in rows["single"]]
    for key, group in rows.items():
        for row in group:
            assert len(row["losses"]) == r["steps"] and row["losses"][-1] < row["losses"][0], (key, row["name"])
            worst = max(max_rel_dev(row["losses"], want) for want in [*oracles, group[0]["losses"]])
            assert worst <= PYTORCH_TOLERANCE, (key, row["name"], worst)
            assert f"| {row['losses'][-1]:.6f} | {row['dev_own']:.1e} |" in report, (key, row["name"])
    ranks = [json.loads((out / "raw" / f"torch-rank{i}.json").read_text()) for i in range(r["processes"])]
    assert all(rank[key]["losses"] == ranks[0][key]["losses"] for rank in ranks for key in ("tp-sp", "1f1b"))
    for key in ("tp-sp", "1f1b"):
        (course, _), (gloo, _) = r["formulas"][key]
        torch_sent = sum(rows[key][0]["sent"].values())
        assert gloo <= torch_sent <= 1.005 * gloo, (key, torch_sent, gloo)   # + the loss's small reductions
        assert all(units_in(row["sent"], report) for row in rows[key])
    assert rows["1f1b"][1]["sent"]["collective-permute"] == r["formulas"]["1f1b"][0][0]   # the useful bytes only
    assert r["transformers_max_abs_logit_dev"] < 1e-5 and f"{r['transformers_max_abs_logit_dev']:.1e}" in report
    written = (out / "results.json").stat().st_mtime_ns
    assert all((out / name).stat().st_mtime_ns >= written for name in ("losses.png", "bytes.png"))


def units_in(sent: dict, report: str) -> bool:
    from jaxpar.units import fmt_bytes
    return fmt_bytes(sum(sent.values())) in report


KERNEL_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}   # experiments/08_kernels/README.md's tolerances
KERNEL_LOSS_TOLERANCE = 1e-4


def kernels(r: dict, report: str, out: Path) -> None:
    """Lab 08: every kernel's value and gradients match its reference within its dtype's tolerance, the model's
    losses with the kernels match the dot run on one device and under FSDP, TP and the pipeline; the chunked loss
    never holds the logits; the warm compile reads the cold one's cache."""
    assert "Total lab time" in report
    rows = r["agreement_kernels"]["rows"]
    assert {row["kernel"].split(" (")[0] for row in rows} == {"flash attention", "fused RMSNorm",
                                                              "chunked cross-entropy"}
    assert {row["dtype"] for row in rows} == {"float32", "bfloat16"}
    for row in rows:
        assert len(row["errors"]) == len(row["parts"].split(", ")) >= 3, row
        assert max(row["errors"]) <= KERNEL_TOLERANCE[row["dtype"]], row
    runs = r["agreement_model"]["runs"]
    assert {run["mesh"] for run in runs} >= {"one device", "fsdp=8", "tensor=4 x data=2"}
    assert all(max_rel_dev(run["losses"], runs[0]["losses"]) <= KERNEL_LOSS_TOLERANCE for run in runs), runs
    layouts = r["agreement_strategies"]["rows"]
    assert layouts and all(max(row["loss_rel"], row["grad_norm_rel"]) <= KERNEL_LOSS_TOLERANCE for row in layouts)
    loss = r["loss_memory"]
    assert loss["temp"]["full"] - loss["temp"]["chunked"] == loss["saved"] > 0.5 * loss["logits_bytes"], loss
    cold, warm = r["compilation"]["cold"], r["compilation"]["warm"]
    assert cold["cache_files_after"] > cold["cache_files_before"] == 0
    assert warm["cache_files_after"] == warm["cache_files_before"] == cold["cache_files_after"]


def operations(r: dict, report: str, out: Path) -> None:
    """Lab 09: the failure drill restarts once and ends with the uninterrupted run's losses, re-doing the steps the
    goodput ledger predicts; the run resharded from 8 devices to 4 continues with the 8-device losses. The losses
    are read from the runs' own metrics.jsonl."""
    assert "failure drill losses vs baseline" in report and "reshard drill" in report

    def losses(run: str) -> dict:
        records = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines() if line]
        return {rec["step"]: rec["loss"] for rec in records if "loss" in rec}
    steps = range(1, r["steps"] + 1)
    base, drill = losses("baseline"), losses("failure")
    assert max_rel_dev([drill[s] for s in steps], [base[s] for s in steps]) <= 1e-4
    failure = r["failure"]["goodput"]
    assert failure["restarts"] == 1 and r["baseline"]["goodput"]["restarts"] == 0
    assert failure["redone_steps"] == r["failure"]["predicted"]["redone_steps"] > 0
    log = (out / "failure.log").read_text()
    assert "restart 1/1 from the last checkpoint" in log, log[-2000:]
    eight, four = losses("reshard-8"), losses("reshard-4")
    after = range(r["reshard"]["resumed_at"] + 1, r["steps"] + 1)
    assert after and max_rel_dev([four[s] for s in after], [eight[s] for s in after]) <= 1e-4


CHECKS = {"zero": zero, "tensor": tensor, "pytorch": pytorch, "kernels": kernels, "operations": operations}
