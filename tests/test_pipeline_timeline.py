"""Lab 04's part c, the profiled timeline, through the user's command: each tick's end is found in the profile
(its sends now sit in switches of their own), and the sheet's table and figure are written."""
import json
import subprocess
import sys


def test_the_timeline_part_finds_every_ticks_end_and_draws(tmp_path):
    out = tmp_path / "lab"
    result = subprocess.run([sys.executable, "-m", "jaxpar.cli", "lab", "pipeline", "--quick", "--parts", "timeline",
                             "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    timeline = json.loads((out / "results.json").read_text())["timeline"]
    assert timeline, "no schedule profiled"
    assert (out / "timeline.png").stat().st_size > 0
    assert "## c. Measured timeline" in (out / "report.md").read_text()
