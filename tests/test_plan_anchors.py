"""`jaxpar plan --framework`: whose η predicts, what it is fitted on and when, and each prediction's range from
leave-one-out over the anchors (plan/anchors.py)."""
import re

import pytest
from test_plan import run_cli

from jaxpar.plan import anchors

STRATEGY = ["plan", "--tokens", "1e12", "--strategy", "fsdp=64 m=1 remat=full bf16 flash"]


def test_leave_one_out_leaves_the_fitted_anchors_out_and_labels_them():
    for framework in set(anchors.FRAMEWORKS.values()):
        fitted = {a.name for a in anchors.fitted_on(framework)}
        left_out = dict(anchors.leave_one_out(framework))
        assert fitted and not fitted & set(left_out) and len(fitted) + len(left_out) == len(anchors.ANCHORS)
        low, high = anchors.spread(framework)
        assert low <= 1 <= high and (low, high) != (1.0, 1.0)
        assert high == pytest.approx(max([1.0, *left_out.values()]))
    rows = {r["anchor"]: r for r in anchors.anchor_table()}
    assert rows["NeMo 24.09 Llama-3.1-8B bf16"]["fitted"] and not rows["NeMo 24.07 Llama-2-7B fp8"]["fitted"]


@pytest.mark.parametrize("framework, name", [("jaxpar", "jaxpar (XLA)"), ("nemo", "NeMo"),
                                             ("torchtitan", "torchtitan compile")])
def test_plan_predicts_with_the_frameworks_eta_and_prints_the_range(capsys, framework, name):
    code, printed, err = run_cli(capsys, [*STRATEGY, "--framework", framework])
    assert code == 0, err
    anchor = next(a for a in anchors.ANCHORS if a.framework == name and a.role == "η")
    assert f"η = {anchors.FITTED[name]['compute']:.4f} fitted {anchors.FITTED_ON} on {anchor.name}" in printed
    found = re.search(r"- step: ([\d.]+) s \(([\d.]+)-([\d.]+) s, leave-one-out", printed)
    step, low, high = map(float, found.groups())
    factors = anchors.spread(name)
    for printed_end, factor in ((low, factors[0]), (high, factors[1])):   # each printed to 4 decimals, as is step
        assert printed_end == pytest.approx(step * factor, abs=5e-5 * (1 + factor) + 1e-9)


def test_the_framework_changes_the_prediction_and_a_bad_one_is_refused(capsys):
    steps = {}
    for framework in ("jaxpar", "torchtitan"):
        code, printed, _ = run_cli(capsys, [*STRATEGY, "--framework", framework])
        steps[framework] = float(re.search(r"- step: ([\d.]+) s", printed).group(1))
    assert steps["torchtitan"] > steps["jaxpar"]                     # its η is lower
    code, _, err = run_cli(capsys, [*STRATEGY, "--framework", "xla"])
    assert code == 2 and err[0].startswith("error: --framework: is 'xla'; valid: jaxpar, maxtext, nemo, megatron, "
                                           "torchtitan")


def test_the_range_is_in_the_json_and_plan_json(capsys, tmp_path):
    """--json and plan.json carry the leave-one-out range the report prints: the factors, each anchor's ratio,
    and every candidate's step time times those factors."""
    import json
    code, _, err = run_cli(capsys, [*STRATEGY, "--framework", "nemo", "--json", str(tmp_path / "one.json"),
                                    "--out", str(tmp_path)])
    assert code == 0, err
    low, high = anchors.spread("NeMo")
    for path, rows in (("one.json", "candidates"), ("plan.json", "ranked")):
        written = json.loads((tmp_path / path).read_text())
        assert written["range"]["framework"] == "nemo" and written["range"]["step_factors"] == [low, high]
        assert written["range"]["leave_one_out"] == dict(anchors.leave_one_out("NeMo"))
        row = written[rows][0]
        assert row["step_s_range"] == pytest.approx([row["step_s"] * low, row["step_s"] * high])
