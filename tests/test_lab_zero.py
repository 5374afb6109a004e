"""Lab 02: `jaxpar memory` against the ZeRO paper's numbers, and bad flags. The lab's own run and the numbers its
sheet relies on: `jaxpar lab zero --quick` from the installed wheel (tests/test_journeys.py, tests/lab_results.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpar.cli import main
from jaxpar.measure.memory import model_state_table

ROOT = Path(__file__).resolve().parent.parent


def run_main(capsys, argv):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


# ---------------------------------------------------------------------------- jaxpar memory

def test_memory_reproduces_the_zero_paper(capsys):
    """ZeRO paper, Figure 1: 7.5B params, 64 devices, mixed-precision Adam (K = 12): 120, 31.4, 16.6, 1.9 GB."""
    code, out, err = run_main(capsys, ["memory", "--params", "7.5e9", "--devices", "64"])
    assert code == 0 and not err
    paper = out.split("## ZeRO paper")[1].split("## jaxpar")[0]
    totals = [line.split("|")[-2].strip() for line in paper.splitlines() if line.startswith("| DDP")
              or line.startswith("| ZeRO")]
    assert totals == ["120.000", "31.406", "16.641", "1.875"]
    assert "| ZeRO-2 | 2Ψ + 14Ψ/N |" in paper and "K = 12" in paper

    code, out, _ = run_main(capsys, ["memory", "--params", "7.5B", "--devices", "64", "--json"])
    table = json.loads(out)
    psi, n = 7.5e9, 64
    assert [r["total"] for r in table["paper"]["rows"]] == pytest.approx(
        [16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n, 16 * psi / n])
    # jaxpar stores fp32 params (the master weights) and fp32 grads: 4 + 4 + Adam 8
    assert [r["total"] for r in table["jaxpar"]["rows"]] == pytest.approx(
        [16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n, 16 * psi / n])
    assert table["jaxpar"]["rows"][2]["grads"] == pytest.approx(4 * psi / n)


def test_memory_optimizers_and_precisions():
    psi, n = 1e9, 8
    fp32 = model_state_table(psi, n, "adam", "fp32")
    assert fp32["paper"]["rows"][0]["total"] == fp32["jaxpar"]["rows"][0]["total"] == 16 * psi
    sgd = model_state_table(psi, n, "sgd", "mixed")
    assert sgd["paper"]["bytes_per_param"] == {"params": 2, "grads": 2, "optimizer": 8}   # master + momentum
    assert sgd["jaxpar"]["rows"][3]["total"] == pytest.approx(12 * psi / n)
    bf16 = model_state_table(psi, n, "adam", "bf16")
    assert bf16["paper"]["rows"][0]["total"] == 8 * psi
    assert bf16["jaxpar"]["rows"] == fp32["jaxpar"]["rows"]        # jaxpar's bf16 is compute-only
    assert model_state_table(psi, n, "adafactor")["paper"]["bytes_per_param"]["optimizer"] == 4


@pytest.mark.parametrize("argv, flag", [
    (["--params", "0", "--devices", "64"], "--params"),
    (["--params=-7.5e9", "--devices", "64"], "--params"),
    (["--params", "lots", "--devices", "64"], "--params"),
    (["--params", "7.5e9", "--devices", "0"], "--devices"),
    (["--params", "7.5e9", "--devices", "1.5"], "--devices"),
    (["--params", "7.5e9", "--devices", "64", "--optimizer", "lion"], "--optimizer"),
    (["--params", "7.5e9", "--devices", "64", "--precision", "fp16"], "--precision"),
])
def test_memory_bad_flags_exit_2_with_one_line(capsys, argv, flag):
    code, out, err = run_main(capsys, ["memory", *argv])
    assert code == 2 and not out
    assert len(err) == 1 and err[0].startswith(f"error: {flag}: "), err


# ---------------------------------------------------------------------------- jaxpar lab zero

def test_lab_bad_input_exits_2(capsys, tmp_path):
    code, _, err = run_main(capsys, ["lab", "zero", "--out", str(tmp_path / "lab"), "--steps", "0"])
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --steps: ")
    code, _, err = run_main(capsys, ["lab", "zero", "--out", str(tmp_path / "lab"), "--precisions", "fp64"])
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --precisions: ")
    code, _, err = run_main(capsys, ["lab", "zero", "--out", str(tmp_path / "lab"), "--parts", "memory,speed"])
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --parts: unknown speed; valid: equivalence")
    assert not (tmp_path / "lab").exists()
    # the standalone script: same checks, same one line
    result = subprocess.run([sys.executable, str(ROOT / "experiments" / "02_zero" / "run.py"), "--cpu-devices", "8",
                             "--remat-repeats", "0"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().startswith("error: --remat-repeats: ")
    assert len(result.stderr.strip().splitlines()) == 1
