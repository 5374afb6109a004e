"""The platform a command starts JAX on: CPU alone where it runs on CPU devices or the machine has no accelerator,
so that an installed CUDA plugin (for deviceless GPU compiles) prints no "Unable to load CUDA" traceback."""
import os
import subprocess
import sys
from pathlib import Path

from jaxpar.env import cpu_platform_only, has_accelerator
from jaxpar.measure.targets import gpu_plugin_problem

ROOT = Path(__file__).resolve().parent.parent


def test_platform_choice(tmp_path):
    bare, gpu = tmp_path / "bare", tmp_path / "gpu"
    bare.mkdir()
    gpu.mkdir()
    (gpu / "nvidia0").touch()
    assert not has_accelerator(bare) and has_accelerator(gpu)
    assert cpu_platform_only({}, wants_cpu=False, dev=bare)          # no GPU here: CPU alone
    assert not cpu_platform_only({}, wants_cpu=False, dev=gpu)       # a GPU machine's train uses its GPUs
    assert cpu_platform_only({}, wants_cpu=True, dev=gpu)            # --cpu-devices / a dry run: CPU even there
    assert not cpu_platform_only({"JAX_PLATFORMS": "cuda"}, wants_cpu=True, dev=bare)   # the user's choice wins
    assert not cpu_platform_only({"JAX_PLATFORMS": ""}, wants_cpu=True, dev=bare)


# The real command line up to the command itself, which only reports the platform JAX started with.
CHILD = """
import os, sys
import jax
from jaxpar import cli
def report(args):
    print(os.environ.get("JAX_PLATFORMS"), jax.config.jax_platforms, jax.default_backend(), jax.device_count())
    return 0
cli.COMMANDS["train"] = report
sys.exit(cli.main(sys.argv[1:]))
"""


def test_cpu_command_starts_on_cpu_alone():
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    run = subprocess.run([sys.executable, "-c", CHILD, "train", "--config", "configs/test.py", "--cpu-devices", "2"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["cpu", "cpu", "cpu", "2"], run.stdout
    if gpu_plugin_problem() is None:     # with the CUDA plugin installed: it stays quiet
        assert "Unable to load CUDA" not in run.stderr and "Traceback" not in run.stderr, run.stderr
