"""Every lab sheet shows at least one committed figure, and the ones experiments/figures.py keeps carry its record.

A sheet's figures/ PNGs come from one run of `python experiments/figures.py LAB`: figures.json beside them holds
the run's date, machine, load and commit, and the sheet's caption line is the one that record gives.
"""
import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHEETS = sorted((ROOT / "experiments").glob("*/README.md"))
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.png)\)")


def figures_module():
    """experiments/figures.py as a module (experiments/ is not a package)."""
    spec = importlib.util.spec_from_file_location("lab_figures", ROOT / "experiments" / "figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_lab_sheet_has_a_figure_entry():
    folders = {folder for folder, _, _ in figures_module().FIGURES.values()}
    assert folders == {sheet.parent.name for sheet in SHEETS}


@pytest.mark.parametrize("sheet", SHEETS, ids=[s.parent.name for s in SHEETS])
def test_sheet_embeds_a_committed_figure(sheet):
    images = IMAGE.findall(sheet.read_text())
    assert images, f"{sheet.relative_to(ROOT)} embeds no figure"
    missing = [i for i in images if not (sheet.parent / i).is_file()]
    assert not missing, f"{sheet.relative_to(ROOT)} embeds figures that are not in the repository: {missing}"


@pytest.mark.parametrize("sheet", SHEETS, ids=[s.parent.name for s in SHEETS])
def test_kept_figures_carry_their_runs_record(sheet):
    module = figures_module()
    kept = [i for i in IMAGE.findall(sheet.read_text()) if i.startswith("figures/")]
    if not kept:
        pytest.skip("no figures/ PNG embedded")
    record = json.loads((sheet.parent / "figures" / "figures.json").read_text())
    lab = next(name for name, (folder, _, _) in module.FIGURES.items() if folder == sheet.parent.name)
    assert {i.removeprefix("figures/") for i in kept} <= set(record["figures"])
    captions = [line for line in sheet.read_text().splitlines() if line.startswith(module.CAPTION)]
    assert captions and set(captions) == {module.caption(lab, record)}, \
        f"{sheet.relative_to(ROOT)}: its caption is not its figures.json's (python experiments/figures.py --captions)"
