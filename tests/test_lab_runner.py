"""The parts runner every lab shares (jaxpar/labs/base/runner.py): the chosen parts in the lab's order, each kept in
results.json and the sheet, and a part that fails leaves the parts before it and its error in the run directory."""
import json

import pytest

from jaxpar.config import ConfigError
from jaxpar.labs.base.runner import Part, chosen_parts, run_parts


def test_parts_are_checked_and_run_in_the_labs_order():
    assert chosen_parts("c, a", ("a", "b", "c")) == ["a", "c"]
    for bad in ("a,x", ""):
        with pytest.raises(ConfigError, match="--parts"):
            chosen_parts(bad, ("a", "b", "c"))


def test_results_sheet_and_figures_of_every_part(tmp_path):
    drawn = []
    parts = [Part("first part", lambda: {"markdown": "one", "value": 1}, "first", "## a. First"),
             Part("second", lambda: {"markdown": "two"})]
    plots = {"first.png": ("first", lambda result, path: drawn.append((result["value"], path.name)))}
    results = run_parts("test", tmp_path, parts, {"date": "today"}, ["# header"], plots, start=0.0,
                        compiles=lambda: (3, 1.5), log=lambda line: None)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved == json.loads(json.dumps(results)) and list(saved) == ["date", "first", "second", "total_seconds"]
    assert drawn == [(1, "first.png")]
    sheet = (tmp_path / "report.md").read_text().split("\n\n")
    assert sheet[:4] == ["# header", "## a. First", "one", "two"]
    assert sheet[4].startswith("Total lab time") and "(3 compiles, 1.5 s of them), parts: first part" in sheet[4]


def test_a_failing_part_keeps_the_parts_before_it(tmp_path):
    def broken():
        raise RuntimeError("out of memory")

    parts = [Part("first", lambda: {"markdown": "one"}), Part("second", broken), Part("third", lambda: {})]
    with pytest.raises(RuntimeError, match="out of memory"):
        run_parts("test", tmp_path, parts, {}, ["# header"], {}, start=0.0, log=lambda line: None)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["first"]["markdown"] == "one" and "third" not in saved
    assert saved["failed"] == {"part": "second", "error": "RuntimeError: out of memory"}
    assert (tmp_path / "report.md").read_text().startswith("# header\n\none\n\nTotal lab time")
