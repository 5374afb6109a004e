"""Lab 07 on the tiny test model (parts a and b: one run shared by the tests below): expert parallelism
reproduces the single device, the manual all_to_alls move the bytes the formula says; parts c and e's
bookkeeping and plots over known numbers. (Parts c-e train for minutes: the full lab's run, recorded in
experiments/07_moe/README.md, is their measurement.)

"The same grouping" for the capacity dispatch: capacity is counted per group of
`model.moe.group_sequences` consecutive sequences of a device's batch shard (config validation
refuses groups that would straddle devices), so one device and eight devices cut the batch into the
same groups and drop the same assignments.
"""
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.config import apply_overrides, load_config

ROOT = Path(__file__).resolve().parent.parent
TINY_MOE = ["--config", "configs/test.py", "--set", "model.moe.experts=8", "--set", "model.moe.top_k=2",
            "--set", "data.seq_len=32"]


def run_main(capsys, argv):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    out = tmp_path_factory.mktemp("lab-moe") / "lab"
    parts = ["--parts", "equivalence,communication"]
    assert main(["lab", "moe", *TINY_MOE, "--out", str(out), "--steps", "5", *parts]) == 0
    return out, json.loads((out / "results.json").read_text())


def test_lab_writes_every_table_and_plot(lab):
    out, _ = lab
    for name in ("report.md", "results.json", "config.json", "equivalence.png", "communication.png"):
        assert (out / name).stat().st_size > 0, name
    report = (out / "report.md").read_text()
    for part in ("## a. Equivalence", "## b. Communication", "Total lab time"):
        assert part in report


MANUAL_DROPLESS = ("dropless: manual EP expert=8", "dropless: manual EP expert=4 x data=2",
                   "dropless: manual EP expert=2 x fsdp=2 x tensor=2")
PADDED = "dropless: manual EP expert=8, padded exchange"


def test_dropless_manual_and_automatic_expert_parallel_match_single_device(lab):
    runs = lab[1]["equivalence"]["runs"]
    assert {*MANUAL_DROPLESS, PADDED, "dropless: auto EP expert=8"} < set(runs)
    assert runs["dropless: single device"]["losses"][-1] < runs["dropless: single device"]["losses"][0]
    for label, run in runs.items():
        assert len(run["losses"]) == 5 and run["max_rel_dev"] <= 1e-4, label


def test_capacity_expert_parallel_drops_what_one_device_drops(lab):
    runs = {k: v for k, v in lab[1]["equivalence"]["runs"].items() if k.startswith("capacity")}
    assert len(runs) == 3 and all(run["within_tolerance"] for run in runs.values())
    dropped = [run["dropped"] for run in runs.values()]
    assert dropped[0] > 0 and dropped == pytest.approx([dropped[0]] * 3, abs=1e-7)


def test_manual_all_to_all_bytes_match_the_formula(lab):
    rows = lab[1]["communication"]["rows"]
    capacity = rows["capacity 1.0: manual EP expert=8"]
    assert capacity["all_to_all"] == pytest.approx(capacity["formula"], rel=0.05)      # the 5%
    for label in (*MANUAL_DROPLESS, PADDED):               # exactly as built
        row = rows[label]
        assert row["all_to_all"] == pytest.approx(row["predicted"], rel=1e-6), label
        # capacity chunks: ceil(1.25·T·k/N) rows each; padded: N·min(k, E/N)/k x formula (4 here)
        low, high = (3.9, 4.1) if label == PADDED else (1.0, 1.3)
        assert low * row["formula"] < row["all_to_all"] < high * row["formula"], label
    assert rows["capacity 1.0: auto EP expert=8"]["by_op_expert_axes"]["all-to-all"]["bytes"] > 0


class RecordedLab:
    """Stands in for `labs.moe.Lab` in parts c and e: their bookkeeping, tables and plots over known numbers
    (the training itself is what the recorded lab run in experiments/07_moe/README.md measured)."""

    def __init__(self, config, runs):
        self.base, self.runs, self.n = config, runs, 8

    def build(self, label, overrides, devices=1):
        from jaxpar.model.transformer import ModelConfig
        config = load_config("configs/test.py")
        apply_overrides(config, ["model.moe.experts=8", *overrides])
        return types.SimpleNamespace(label=label, strategy=types.SimpleNamespace(
            model_cfg=ModelConfig.from_config(config.model, 512)))

    def run(self, built, steps, keep=(), evaluate=False):
        return self.runs(built.label, steps)


def test_balance_part_tables_and_heatmaps(tmp_path):
    """Coefficient of variation and dropped fraction from per-step loads, per method; the plots draw them."""
    from jaxpar.labs.moe import lab as lab_moe
    from jaxpar.labs.moe import plots as moe_plots
    config = load_config("configs/test.py")
    apply_overrides(config, ["model.moe.experts=8"])
    balanced, skewed = np.full(8, 1 / 8), np.array([0.5, 0.5, 0, 0, 0, 0, 0, 0])

    def runs(label, steps):
        load = skewed if label.endswith("none") else balanced          # "none" collapses onto two experts
        dropped = np.where(load > 0.25, load - 0.25, 0.0)
        return {"moe_routed": [[load, load]] * steps, "moe_dropped": [[dropped, dropped]] * steps,
                "ce": [3.0] * steps, "losses": [3.0] * steps, "times": [0.1] * steps, "val_loss": 3.1}

    result = lab_moe.balance(RecordedLab(config, runs), steps=20, bias_rate=0.01)
    none, aux = result["runs"]["none"], result["runs"]["aux loss"]
    assert none["cv_end"] == pytest.approx(np.sqrt(3)) and aux["cv_end"] == pytest.approx(0.0, abs=1e-12)
    assert none["dropped_end"] == pytest.approx(0.5) and aux["dropped_mean"] == 0
    assert "| none | 1.732 | 1.732 |" in result["markdown"]
    moe_plots.plot_balance(result, tmp_path / "balance.png")
    moe_plots.plot_heatmaps(result, tmp_path / "heatmaps.png")
    assert (tmp_path / "balance.png").stat().st_size > 0 and (tmp_path / "heatmaps.png").stat().st_size > 0


def test_moe_vs_dense_compares_equal_active_flops(tmp_path):
    from jaxpar.labs.moe import lab as lab_moe
    from jaxpar.labs.moe import plots as moe_plots
    config = load_config("configs/test.py")
    apply_overrides(config, ["model.moe.experts=8", "model.moe.top_k=2"])
    def curve(label, steps):
        return {"ce": list(np.linspace(6, 4, steps)), "val_loss": 4.1, "losses": [0.0] * steps, "times": [0.1] * steps}
    result = lab_moe.moe_vs_dense(RecordedLab(config, curve), steps=10)
    moe, dense = result["runs"]["MoE"], result["runs"]["dense (MLP 256)"]          # 2 experts x 128 wide
    assert moe["active"] == pytest.approx(dense["active"], rel=0.02) and moe["params"] > 2 * dense["params"]
    assert moe["flops_per_token"] == pytest.approx(dense["flops_per_token"], rel=0.02)
    moe_plots.plot_moe_vs_dense(result, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_lab_bad_input_exits_2(capsys, tmp_path):
    for argv, flag in ((["--steps", "1"], "--steps"), (["--bias-rate", "0"], "--bias-rate"),
                       (["--config", "configs/test.py"], "model.moe.experts")):
        code, _, err = run_main(capsys, ["lab", "moe", "--out", str(tmp_path / "lab"), *argv])
        assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {flag}: "), err
    assert not (tmp_path / "lab").exists()
    result = subprocess.run([sys.executable, str(ROOT / "experiments" / "07_moe" / "run.py"), "--cpu-devices", "3",
                             "--out", str(tmp_path / "lab")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().startswith("error: --cpu-devices: ")
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "lab").exists()


def test_layouts_part_covers_the_hand_written_layouts_and_each_passes_the_checks():
    """Part f (run by the lab, not here: it compiles 20 programs): every pipeline schedule, expert x pipe x data
    and x fsdp, manual TP; each layout's config is accepted by the strategy registry (no compile)."""
    from jaxpar.labs.moe.layouts import LAYOUTS, MODEL
    from jaxpar.labs.pipeline.moe import MOE_MODEL
    from jaxpar.parallel.registry import select

    seen = set()
    for label, (overrides, devices, _) in LAYOUTS:
        config = load_config(None)
        apply_overrides(config, [*MODEL, *MOE_MODEL, *overrides])
        sizes = {axis: int(config.mesh[axis]) for axis in ("data", "fsdp", "pipe", "expert", "tensor")}
        assert np.prod(list(sizes.values())) == devices, label
        select(config, sizes)
        seen.add(config.parallel.pipe)
        if sizes["expert"] > 1 and sizes["pipe"] > 1:
            seen.add("expert x pipe x " + ("data" if sizes["data"] > 1 else "fsdp" if sizes["fsdp"] > 1 else "-"))
        if config.parallel.tensor == "manual":
            seen.add("manual tp" + (" + fsdp" if sizes["fsdp"] > 1 else ""))
    assert {"gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev", "expert x pipe x data", "expert x pipe x fsdp",
            "manual tp", "manual tp + fsdp"} <= seen
