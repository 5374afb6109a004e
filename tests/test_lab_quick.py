"""`jaxpar lab NAME --quick`: every lab has it, it changes the lab's defaults, and flags given explicitly win
(parsing only: the quick runs themselves are the CI's journeys)."""
import pytest

from jaxpar.cli import LAB_ALIASES, LABS, build_parser

# the PyTorch lab's --quick is its own (its journey runs it: tests/test_journeys.py::test_lab_quick[pytorch])
NAMES = [name for name, *_ in (*LAB_ALIASES, *LABS) if name != "pytorch"]


def parse(argv):
    return vars(build_parser(argv).parse_args(argv))


@pytest.mark.parametrize("name", NAMES)
def test_every_lab_has_a_quick_size(name):
    plain, quick = parse(["lab", name]), parse(["lab", name, "--quick"])
    assert not plain["quick"] and quick["quick"]
    changed = {k for k in plain if k != "quick" and plain[k] != quick[k]}
    assert changed, f"lab {name}: --quick changes nothing"


def test_flags_given_win_over_quick_in_any_order():
    quick = parse(["lab", "zero", "--quick"])
    assert (quick["steps"], quick["precision_steps"], quick["cpu_devices"]) == (2, 2, 8)
    for argv in (["lab", "zero", "--steps", "10", "--quick"], ["lab", "zero", "--quick", "--steps", "10"]):
        args = parse(argv)
        assert (args["steps"], args["precision_steps"]) == (10, 2), argv   # 10 is also the default: still given
    args = parse(["lab", "tensor", "--set", "model.layers=3", "--quick"])
    assert args["overrides"] == ["model.kv_heads=4", "model.layers=3"]    # the user's --set after quick's


def test_quick_in_a_standalone_run_py():
    """experiments/NN/run.py parses with a plain argparse parser and the lab's own arguments."""
    import argparse

    from jaxpar.labs.arguments import pipeline
    p = argparse.ArgumentParser()
    pipeline(p)
    args = p.parse_args(["--quick", "--warmup", "2"])
    assert (args.quick, args.steps, args.warmup, args.pipedream_steps, args.cpu_devices) == (True, 1, 2, 3, 8)
