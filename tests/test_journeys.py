"""Journeys: every command the README and the lab sheets print, run at smoke size the way a user runs it.

The wheel is built from this checkout and installed into a fresh virtual environment outside it (jax and the
other dependencies come from the running environment, not reinstalled); every command runs with that
environment's `jaxpar`, from one temporary folder (never the checkout), in the order the documents print them
(`jaxpar sample` reads the run the quick start wrote there). The commands are read from the documents
(tests/journeys.py), so a new documented command is covered by construction; `jaxpar plan --sweep`'s job array and
`jaxpar slurm`'s CPU job run on a real local Slurm cluster (skipped where Slurm is not installed); every lab listed
by `jaxpar lab --help` runs end to end as `jaxpar lab NAME --quick`.
"""
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import journeys as docs
import lab_results
import pytest

from jaxpar.measure.targets import gpu_plugin_problem

ROOT = docs.ROOT
CLUSTER = ROOT / "scripts" / "slurm" / "local-cluster.sh"
SLURM_MISSING = [b for b in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(b) is None]
TIMEOUT_S = 900
COMMANDS, DOCUMENTED_LABS = docs.journeys()
LABS = docs.lab_names(subprocess.run([sys.executable, "-m", "jaxpar.cli", "lab", "--help"], capture_output=True,
                                     text=True, check=True, timeout=120).stdout)
pytestmark = pytest.mark.journeys
IGNORED_IN_COPY = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "runs",
                                         "__pycache__", ".pytest_cache", ".cache")


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """A fresh virtual environment outside the checkout holding the wheel built from it: its bin/ folder.

    The running environment (CI's) has jaxpar installed editable; its site-packages joins the new environment's
    path through a plain .pth line, after the new site-packages and without running that folder's own .pth files,
    so the editable finder never loads and `import jaxpar` is the wheel's, while jax and the rest are reused.
    """
    base = tmp_path_factory.mktemp("wheel-install")
    source, wheels, venv = base / "source", base / "wheels", base / "venv"
    shutil.copytree(ROOT, source, ignore=IGNORED_IN_COPY)       # a copy: the build leaves build/ and egg-info
    isolation = ["--no-build-isolation"] if _has_setuptools() else []
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(wheels), str(source)])
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
          str(next(wheels.glob("jaxpar-*.whl")))])
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip()
    parents = _run([sys.executable, "-c", "import site; print('\\n'.join(site.getsitepackages()))"])
    (Path(site) / "_running_environment.pth").write_text(parents)
    where = _run([str(python), "-c", "import jaxpar, jax; print(jaxpar.__file__)"], env=_clean_env(),
                 cwd=base).strip()                        # not the checkout: `python -c` imports from its folder
    assert Path(where).is_relative_to(venv), f"jaxpar imports from {where}, not from the wheel in {venv}"
    return venv / "bin"


def _has_setuptools() -> bool:
    try:
        from setuptools import __version__
    except ImportError:
        return False
    return int(__version__.split(".")[0]) >= 77


def _run(argv, **kwargs) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, **kwargs)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout


def _clean_env(**extra) -> dict[str, str]:
    """The user's environment: no PYTHONPATH pointing into a checkout, XLA at -O0 as in tests/conftest.py."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def user(installed, tmp_path_factory):
    """Where the user types: a temporary folder, PATH starting at the installed environment."""
    folder = tmp_path_factory.mktemp("user-folder")
    env = _clean_env(PATH=f"{installed}{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=str(installed.parent))
    return folder, env


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
    """JAX's persistent compilation cache for the documented commands (not the labs, which time compiles): the
    processes of a launch or a Slurm job, and the job after the launch, compile the same programs."""
    return {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("journeys-compilation-cache"))}


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """Start a one-node Slurm cluster on first use (scripts/slurm/local-cluster.sh), stop it after the module."""
    started = {}

    def start():
        if not started:
            state = tmp_path_factory.mktemp("journeys-slurm")
            env = {**os.environ, "SLURMCTLD_PORT": str(7800 + 2 * (os.getpid() % 100))}
            done = subprocess.run(["bash", str(CLUSTER), "start", str(state), "8"], capture_output=True, text=True,
                                  timeout=60, env=env)
            assert done.returncode == 0, done.stderr
            started.update(state=state, env=env, conf=str(state / "slurm.conf"))
        return started["conf"]
    yield start
    if started:
        subprocess.run(["bash", str(CLUSTER), "stop", str(started["state"])], timeout=30, env=started["env"])


def _expanded(word: str, cwd: Path, env) -> str:
    """`$(...)` in a documented word, as the shell expands it (the README's `"$(ls -td runs/default-* | head -1)"`)."""
    if "$(" not in word:
        return word
    return subprocess.run(["bash", "-c", f'printf %s "{word}"'], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=30).stdout


def _tail(text: str, n=3000) -> str:
    return text[-n:]


def _run_jaxpar(command, argv, cwd, env):
    argv = [_expanded(w, cwd, env) for w in argv]
    env = {**env, **command.env}
    if "--xla_backend_optimization_level=0" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]))
    start = time.monotonic()
    done = subprocess.run(["jaxpar", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if command.stdout:
        (cwd / command.stdout).write_text(done.stdout)
    return done, time.monotonic() - start


def _writer(command):
    """The documented `jaxpar ... --out SCRIPT` that writes the script `command` (sbatch SCRIPT) submits: the last one
    before it in its own document."""
    document, line = command.where.rsplit(":", 1)
    writers = [c for c in docs.documented((document,)) if c.program == "jaxpar"
               and docs.option(c.argv, "--out") == command.argv[0] and int(c.where.rsplit(":", 1)[1]) < int(line)]
    return writers[-1] if writers else None


def _sbatch(command, cwd, env, slurm_cluster):
    script = cwd / command.argv[0]
    writer = _writer(command)
    if not script.is_file() and writer is not None:     # its writer ran in another folder (another worker's), or
        argv = docs.smoke(writer.argv, docs.Machine())  # was taken as another document's journey of one shape
        done, _ = _run_jaxpar(writer, argv, cwd, env)
        assert done.returncode == 0, f"{writer.where}: `{writer.text}` exited {done.returncode}: {_tail(done.stderr)}"
    assert script.is_file(), f"{command.where}: `{command.text}`: no {script.name} (the command before wrote none)"
    if "--gpus" in script.read_text():
        pytest.skip(f"{script.name} asks for GPUs")
    if SLURM_MISSING:
        pytest.skip(f"Slurm is not installed here (no {', '.join(SLURM_MISSING)}); "
                    "`scripts/slurm/local-cluster.sh install` installs it (apt, root)")
    env = {**env, "SLURM_CONF": slurm_cluster()}
    job = subprocess.run(["sbatch", "--parsable", command.argv[0]], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=30)
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip().split(";")[0]
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and subprocess.run(["squeue", "-h", "-j", job_id], env=env,
                                                         capture_output=True, text=True).stdout.strip():
        time.sleep(1)
    shown = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    codes = [f for f in shown.split() if f.startswith(("JobState=", "ExitCode="))]
    logs = "\n".join(f"--- {p}\n{_tail(p.read_text(), 1500)}" for p in sorted(cwd.rglob("*.out")))
    assert codes and all(c.endswith(("=COMPLETED", "=0:0")) for c in codes), \
        f"{command.where}: `{command.text}`: the job ended {codes or 'unseen'}\n{logs}"


# Documented commands (by the start of their text) that another test runs the same way: left out of CI like a heavy
# lab, each for the reason given (`pytest -m journeys` runs them). `jaxpar launch` itself stays in CI (docs/running.md).
RUN_ELSEWHERE = {
    "sbatch job.sbatch": "tests/test_slurm.py submits the script `jaxpar slurm` renders for it (2 tasks x 4 CPU "
                         "devices, --loopback) to a local cluster and checks its losses",
    "jaxpar launch --nproc 2 --cpu-devices 4 -- bench collectives": "tests/test_bench_collectives.py::"
                                                                   "test_two_processes runs the benchmark on 2 "
                                                                   "processes x 4 CPU devices",
    **dict.fromkeys(("jaxpar plan --config configs/test.py --set model.vocab_size=512 --cpu-devices 8 --tokens 1e6 "
                     "--sweep", "sbatch runs/sweep/sweep.sbatch", "jaxpar plan collect runs/sweep"),
                    "tests/test_plan_sweep.py::test_sweep_runs_as_a_slurm_job_array writes a sweep of the test model, "
                    "runs its job array on a local cluster and collects it"),
}


def _command_case(command):
    marks = [pytest.mark.heavy_journey] if command.text.startswith(tuple(RUN_ELSEWHERE)) else []
    return pytest.param(command, marks=marks, id=f"{command.where} {command.text}"[:150])


@pytest.mark.parametrize("command", [_command_case(c) for c in COMMANDS])
def test_documented_command(command, user, slurm_cluster, compilation_cache):
    cwd, env = user
    env = {**env, **compilation_cache}
    if command.program == "sbatch":
        return _sbatch(command, cwd, env, slurm_cluster)
    try:
        argv = docs.smoke(command.argv, docs.Machine(gpu=shutil.which("nvidia-smi") is not None,
                                                     plugin_problem=gpu_plugin_problem()))
    except docs.Skip as reason:
        pytest.skip(str(reason))
    done, seconds = _run_jaxpar(command, argv, cwd, env)
    shown = " ".join(argv)
    assert done.returncode == 0, (f"{command.where}: `{command.text}` (run as `jaxpar {shown}` in {cwd}) exited "
                                  f"{done.returncode} after {seconds:.0f} s:\n{_tail(done.stdout + done.stderr)}")
    assert "Traceback" not in done.stderr, _tail(done.stderr)


def test_commands_are_read_as_the_shell_reads_them():
    line = "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && jaxpar train --cpu-devices 8"
    assert [c.argv for c in docs.commands_of(line, "x")] == [["train", "--cpu-devices", "8"]]
    (c,) = docs.commands_of("JAX_PLATFORMS=cpu .venv/bin/jaxpar k8s --image I -- --config F > job.yaml  # note", "x")
    assert (c.env, c.argv, c.stdout) == ({"JAX_PLATFORMS": "cpu"}, ["k8s", "--image", "I", "--", "--config", "F"],
                                         "job.yaml")
    assert docs.elided(docs.commands_of("jaxpar train ... --set a=1", "x")[0])
    with pytest.raises(AssertionError, match="no smoke size"):
        docs.smoke(["newcommand", "--flag"])
    assert docs.smoke(["launch", "--nproc", "2", "--", "sample", "--run-dir", "r"])[-2:] == ["--max-tokens", "4"]


def test_every_documented_lab_is_listed():
    assert sorted(set(DOCUMENTED_LABS) - set(LABS)) == [], f"documented labs that `jaxpar lab --help` lacks: {LABS}"


# CPU-seconds of each lab's quick run at -O0 on the shared 2-core VM, 2026-12-02 (they grow with load: zero took 43 at
# load 1-3, 51 at load 14; kernels 100 at load 9, 115 at load 22-35): tensor, kernels, operations, pytorch from the
# wheel at load 7-9 (`pytest -m journeys -rP -k test_lab_quick` prints each lab's); collectives from the wheel at load
# 20; dryrun and zero from the wheel at load 13-18; the others at load 4-15.
# CI runs the labs of at most CI_LAB_CPU_S: 00-03, 06, 08, 09, about 7 CPU-minutes together (the limit lies between
# them and the next, overlap; their runs check the numbers their sheets rely on, tests/lab_results.py); every lab runs
# with `pytest -m journeys`. The labs left out of CI run end to end there through the CLI at another size: moe
# (tests/test_moe_lab.py), capstone (tests/test_capstone.py).
QUICK_CPU_S = {"dryrun": 9, "collectives": 5, "zero": 51, "tensor": 99, "pipeline": 302, "moe": 225, "kernels": 100,
               "operations": 99, "overlap": 211, "capstone": 226, "pytorch": 38}
CI_LAB_CPU_S = 150
OPTIONAL_EXTRAS = {"pytorch": ("torch", "transformers")}     # the lab's extra (pyproject.toml); CI installs it


def _children_cpu_s() -> float:
    """CPU-seconds of this process's finished children and theirs (a lab's processes), as `time` counts them."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _lab_case(name):
    """Each lab in its own xdist group (tests/conftest.py keeps it): under `pytest -n 2` two labs run at once."""
    heavy = QUICK_CPU_S.get(name, CI_LAB_CPU_S + 1) > CI_LAB_CPU_S      # a new lab counts as heavy until measured
    marks = [pytest.mark.xdist_group(f"journey-lab-{name}"), *([pytest.mark.heavy_journey] if heavy else [])]
    return pytest.param(name, marks=marks)


# Longest first: xdist's loadgroup hands out the one-test groups in this order, so the short labs fill the end.
@pytest.mark.parametrize("name", [_lab_case(name) for name in sorted(LABS, key=lambda n: -QUICK_CPU_S.get(n, 0))])
def test_lab_quick(name, user):
    """`jaxpar lab NAME --quick --out DIR`: exit 0, and DIR holds a results JSON, a figure and a markdown sheet."""
    missing = [m for m in OPTIONAL_EXTRAS.get(name, ()) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"lab {name} needs {', '.join(missing)}, not installed (the torch extra; its CPU-only install: "
                    "experiments/06_pytorch/README.md)")
    cwd, env = user
    out = cwd / f"lab-{name}"
    command = docs.Command("jaxpar", ["lab", name, "--quick", "--out", str(out)], f"jaxpar lab --help: {name}")
    cpu_before = _children_cpu_s()
    done, seconds = _run_jaxpar(command, command.argv, cwd, env)
    print(f"lab {name} --quick: {seconds:.0f} s wall, {_children_cpu_s() - cpu_before:.0f} CPU-s, load "
          f"{os.getloadavg()[0]:.0f} (for QUICK_CPU_S: `pytest -m journeys -rP -k test_lab_quick`)")
    output = _tail(done.stdout + done.stderr)
    assert "unrecognized arguments: --quick" not in done.stderr, \
        f"`jaxpar lab {name}` has no --quick (the smoke size every lab offers):\n{output}"
    assert done.returncode == 0, f"`{command.text}` exited {done.returncode} after {seconds:.0f} s:\n{output}"
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*")) if out.is_dir() else []
    figures = list(out.rglob("*.png"))
    assert list(out.glob("*.json")) and figures and list(out.glob("*.md")), \
        f"`{command.text}`: --out lacks a results JSON, a PNG or a markdown sheet; it holds {files}"
    if name in lab_results.CHECKS:
        lab_results.CHECKS[name](json.loads((out / "results.json").read_text()), (out / "report.md").read_text(), out)
