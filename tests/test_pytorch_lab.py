"""Lab 06 without torch: one line naming the CPU wheel, exit 2. Its quick run (PyTorch TP+SP and 1F1B on 2 gloo
processes beside jaxpar's counterparts on 2 devices, 4 steps) is CI's journey from an installed wheel:
tests/test_journeys.py::test_lab_quick[pytorch], checked by tests/lab_results.py's `pytorch`."""
import sys

from jaxpar import cli
from jaxpar.labs.pytorch import lab


def test_without_torch_one_line_names_the_cpu_wheel_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)           # `import torch` fails; find_spec finds nothing
    out = tmp_path / "out"
    assert cli.main(["lab", "pytorch", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: torch: not installed"), err
    assert f"pip install torch --index-url {lab.TORCH_CPU_INDEX}" in err and not out.exists()
