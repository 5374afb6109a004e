"""Bad input that used to escape: each case exits 2 with one line naming the argument, creates nothing.

The cases run the CLI in-process (the checks are the same code a shell reaches); a
representative few run as real subprocesses, which also shows that refusing them never
imports JAX (the checks come before anything heavy is loaded or built).
"""
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpar.cli import main
from jaxpar.config import base_config, to_json

TINY = "configs/test.py"


def train(*extra):
    return ["train", "--config", TINY, "--run-dir", "{work}/run", *extra]


def train_set(*fields):
    return train(*[arg for field in fields for arg in ("--set", field)])


SAMPLE = ["sample", "--run-dir", "{inputs}/run"]

# (case id, argv, the argument or field the one-line error must name). {work}: the folder that must stay
# empty (run dirs and --out go there, and it is the working directory); {inputs}: prepared input files.
CASES = [
    ("config-not-python", ["train", "--config", "{inputs}/config.json", "--run-dir", "{work}/run"], "--config"),
    ("empty-sample-prompt", train_set("train.sample_prompt="), "train.sample_prompt"),
    ("negative-shuffle-seed", train_set("data.shuffle_seed=-1"), "data.shuffle_seed"),
    ("lr-overflows", train_set("train.lr=1e999"), "train.lr"),
    ("rope-theta-zero", train_set("model.rope_theta=0"), "model.rope_theta"),
    ("adam-eps-zero", train_set("train.eps=0"), "train.eps"),
    ("negative-warmup", train_set("train.warmup_steps=-5"), "train.warmup_steps"),
    ("fault-process-absent", train_set("train.fault_process=7", "train.fault_at_step=2"), "train.fault_process"),
    ("negative-fault-step", train_set("train.fault_at_step=-1"), "train.fault_at_step"),
    ("negative-grad-clip", train_set("train.grad_clip=-1"), "train.grad_clip"),
    ("b1-above-one", train_set("train.b1=2.0"), "train.b1"),
    ("min-lr-ratio-above-one", train_set("train.min_lr_ratio=5.0"), "train.min_lr_ratio"),
    ("negative-weight-decay", train_set("train.weight_decay=-1"), "train.weight_decay"),
    ("metrics-port-busy", train("--metrics-port", "{busy_port}"), "--metrics-port"),
    ("tensorboard-without-tensorboardx", train_set("train.tensorboard=true"), "train.tensorboard"),
    ("sample-top-k-above-vocab", [*SAMPLE, "--top-k", "100000"], "--top-k"),
    ("sample-prompt-not-utf8", [*SAMPLE, "--prompt", "\udcff\udcfe"], "--prompt"),
    ("sample-temperature-nan", [*SAMPLE, "--temperature", "nan"], "--temperature"),
    ("launch-negative-grace", ["launch", "--preempt-grace", "-5", "--", "train", "--config", TINY,
                               "--run-dir", "{work}/run"], "--preempt-grace"),
    ("slurm-time", ["slurm", "--time", "abc"], "--time"),
    ("slurm-job-name-newline", ["slurm", "--job-name", "x\n#SBATCH --uid=0"], "--job-name"),
    ("slurm-out-unwritable", ["slurm", "--out", "/proc/jaxpar-x"], "--out"),
    ("k8s-name-invalid", ["k8s", "--image", "reg/jaxpar:1", "--name", "Bad_Name!"], "--name"),
    ("k8s-image-missing", ["k8s", "--out", "{work}/job.yaml"], "--image"),
    ("k8s-out-unwritable", ["k8s", "--image", "reg/jaxpar:1", "--out", "/proc/jaxpar-x"], "--out"),
    ("bench-out-unwritable", ["bench", "collectives", "--ops", "all-reduce", "--max-bytes", "2K",
                              "--out", "/proc/jaxpar-x"], "--out"),
    ("dryrun-out-unwritable", ["dryrun", "--config", TINY, "--set", "model.vocab_size=512", "--out",
                               "/proc/jaxpar-x"], "--out"),
    ("plan-out-unwritable", ["plan", "--tokens", "1e9", "--out", "/proc/jaxpar-x"], "--out"),
    ("lab-ops-out-unwritable", ["lab", "operations", "--config", TINY, "--out", "/proc/jaxpar-x"], "--out"),
    # Issue 32: the last escapes (tracebacks, jobs written for a config that cannot run, values accepted silently).
    ("collect-candidates-garbage", ["plan", "collect", "{inputs}/sweep-garbage"], "collect"),
    ("collect-candidates-empty-object", ["plan", "collect", "{inputs}/sweep-empty"], "collect"),
    ("collect-results-half-written-and-empty", ["plan", "collect", "{inputs}/sweep"], "collect"),
    ("plan-ep-on-a-dense-model", ["plan", "--tokens", "1e9", "--strategy", "ep=64"], "--strategy"),
    ("plan-strategy-two-precisions", ["plan", "--tokens", "1e9", "--strategy", "fsdp=64 bf16 fp32"], "--strategy"),
    ("plan-strategy-two-schedules", ["plan", "--tokens", "1e9", "--strategy", "fsdp=32 pipe=2 1f1b gpipe"],
     "--strategy"),
    ("plan-strategy-two-microbatches", ["plan", "--tokens", "1e9", "--strategy", "fsdp=64 m=2 m=4"], "--strategy"),
    ("run-dir-name-too-long", ["train", "--config", TINY, "--run-dir", "{work}/" + "r" * 300], "--run-dir"),
    ("name-leaves-runs", ["train", "--config", TINY, "--set", "name=../../escape"], "name"),
    ("name-absolute", ["train", "--config", TINY, "--set", "name={work}/escape"], "name"),
    ("init-std-negative", train_set("model.init_std=-0.1"), "model.init_std"),
    ("slurm-config-missing", ["slurm", "--out", "{work}/job.sbatch", "--", "--config", "{inputs}/nope.py"],
     "--config"),
    ("slurm-unknown-set-field", ["slurm", "--out", "{work}/job.sbatch", "--", "--config", TINY,
                                 "--set", "train.nosuch=1"], "train.nosuch"),
    ("slurm-negative-steps", ["slurm", "--out", "{work}/job.sbatch", "--", "--config", TINY,
                              "--set", "train.steps=-1"], "train.steps"),
    ("k8s-config-missing", ["k8s", "--image", "reg/jaxpar:1", "--out", "{work}/job.yaml", "--", "--config",
                            "{inputs}/nope.py"], "--config"),
    ("k8s-existing-claim-with-size", ["k8s", "--image", "reg/jaxpar:1", "--out", "{work}/job.yaml",
                                      "--existing-claim", "--claim-size", "5Gi"], "--existing-claim"),
    ("k8s-existing-claim-with-class", ["k8s", "--image", "reg/jaxpar:1", "--out", "{work}/job.yaml",
                                       "--existing-claim", "--storage-class", "fast"], "--existing-claim"),
    ("metrics-host-without-port", train("--metrics-host", "0.0.0.0"), "--metrics-host"),
    ("metrics-host-not-here", train("--metrics-port", "9400", "--metrics-host", "192.0.2.1"), "--metrics-host"),
    ("remat-names-unknown", train_set("train.remat=names", "train.remat_names=attn_out,nosuch"),
     "train.remat_names"),
    ("lab-overlap-cpu-part-on-3-devices", ["lab", "overlap", "--parts", "cpu", "--cpu-devices", "3", "--out",
                                           "{work}/lab"], "--cpu-devices"),
    ("lab-overlap-unknown-set-field", ["lab", "overlap", "--set", "model.nosuch=1", "--out", "{work}/lab"],
     "model.nosuch"),
    # Run outside the repository (the working directory is {work}): the lab still finds its default
    # config, so the error is about the bad field, not a missing configs/mixtral_tiny.py.
    ("lab-moe-default-config-anywhere", ["lab", "moe", "--set", "model.layrs=1"], "model.layrs"),
    # Errors that name the fix: a config field given as a flag, a misspelt field, a mesh CPU devices can give.
    ("flag-is-a-config-field", train("--steps", "10"), "--set train.steps=10 (see jaxpar train --help)"),
    ("set-field-misspelt", train_set("train.stesp=10"), "did you mean `train.steps`?"),
    ("mesh-needs-cpu-devices", train_set("mesh.data=16"), "uses 16 devices but 8 are available; make the product "
                                                          "equal the device count or set one axis to -1, or on CPU "
                                                          "run with --cpu-devices 16"),
]


def make_inputs(inputs: Path) -> None:
    """A config that is not Python, and a run directory with what `sample` reads before any checkpoint."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    inputs.mkdir()
    (inputs / "config.json").write_text("{}")
    run = inputs / "run"
    run.mkdir()
    (run / "config.json").write_text(to_json(base_config()))
    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(run / "tokenizer.json"))
    for name, text in (("sweep-garbage", "\x00garbage{"), ("sweep-empty", "{}"), ("sweep", json.dumps(SWEEP))):
        (inputs / name).mkdir()
        (inputs / name / "candidates.json").write_text(text)
    (inputs / "sweep" / "results").mkdir()
    (inputs / "sweep" / "results" / "0.json").write_text('{"index": 0, "strategy": "data=8", "times_s": [0.1')
    (inputs / "sweep" / "results" / "1.json").write_text("{}")   # what a killed array task leaves


# A sweep's candidate list (as `jaxpar plan --sweep` writes it) whose two tasks left a torn file and `{}`.
SWEEP = {"cluster": "8 CPU devices", "global_batch": 8, "seq_len": 16, "steps": 3,
         "candidates": [{"index": i, "strategy": s, "predicted_step_s": 0.1, "predicted_memory": 1e6}
                        for i, s in enumerate(("data=8", "fsdp=8"))]}


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def places(tmp_path, monkeypatch):
    """{work} (empty, the working directory), {inputs} (prepared), {busy_port} (a port something listens on)."""
    work, inputs = tmp_path / "work", tmp_path / "inputs"
    work.mkdir()
    make_inputs(inputs)
    monkeypatch.chdir(work)
    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    yield {"work": str(work), "inputs": str(inputs), "busy_port": str(busy.getsockname()[1])}
    busy.close()


@pytest.mark.parametrize("argv, field", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_refused_in_one_line_before_anything_is_created(capsys, monkeypatch, places, argv, field):
    if field == "train.tensorboard":
        monkeypatch.setitem(sys.modules, "tensorboardX", None)   # `import tensorboardX` raises ImportError
    inputs_before = snapshot(Path(places["inputs"]))
    try:
        code = main([arg.format(**places) for arg in argv])
    except SystemExit as exit_:   # argparse
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("error: ") and field in err[0], err
    assert not any(Path(places["work"]).iterdir()), sorted(Path(places["work"]).rglob("*"))
    assert snapshot(Path(places["inputs"])) == inputs_before


def run_cli(args: list, cwd, *, jax_free: bool = True) -> subprocess.CompletedProcess:
    """The real command line in a fresh interpreter; `jax_free`: also fail if the refusal imported JAX."""
    code = "import sys; from jaxpar.cli import main; rc = main(sys.argv[1:])"
    if jax_free:
        code += "; assert 'jax' not in sys.modules, 'jax was imported'"
    return subprocess.run([sys.executable, "-c", code + "; sys.exit(rc)", *args], capture_output=True,
                          cwd=cwd, timeout=120)


@pytest.mark.parametrize("args, field", [
    (["train", "--config", TINY, "--set", "train.lr=1e999", "--run-dir", "run"], "train.lr"),
    (["slurm", "--job-name", "x\n#SBATCH --uid=0"], "--job-name"),
    (["dryrun", "--config", TINY, "--set", "model.vocab_size=512", "--out", "/proc/jaxpar-x"], "--out"),
    (["sample", "--run-dir", "{inputs}/run", "--prompt", b"\xff\xfe"], "--prompt"),
    (["plan", "--tokens", "1e9", "--gpu", "h1000"], "--gpu"),
    # the mesh and parallel checks: the device count from --cpu-devices, or the mesh's own product
    (["train", "--config", TINY, "--set", "mesh.data=3", "--cpu-devices", "8", "--run-dir", "run"], "mesh"),
    (["train", "--config", TINY, "--set", "mesh.tensor=3", "--run-dir", "run"], "model.heads"),
    (["train", "--config", TINY, "--set", "parallel.sequence=true", "--run-dir", "run"], "parallel.sequence"),
], ids=["train", "slurm", "dryrun", "sample-bytes", "plan", "mesh-vs-cpu-devices", "mesh-tensor", "parallel"])
def test_a_shell_gets_one_line_and_jax_is_never_imported(tmp_path, args, field):
    make_inputs(tmp_path / "inputs")
    work = tmp_path / "work"
    work.mkdir()
    args = [a.replace("{inputs}", str(tmp_path / "inputs")) if isinstance(a, str) else a for a in args]
    result = run_cli(args, work)
    err = result.stderr.decode().strip().splitlines()
    assert result.returncode == 2 and len(err) == 1 and field in err[0], err
    assert not any(work.iterdir())


def test_automatic_vocabulary_that_tensor_does_not_divide_is_refused_before_the_run_dir(tmp_path):
    """model.vocab_size=0 pads the tokenizer's 512 tokens to 512, which mesh.tensor=3 does not divide."""
    sets = ["model.heads=6", "model.kv_heads=3", "model.d_model=96", "model.mlp_dim=192", "mesh.data=1",
            "mesh.tensor=3", "train.steps=2"]
    args = ["train", "--config", TINY, "--cpu-devices", "3", "--run-dir", str(tmp_path / "run"),
            *[a for s in sets for a in ("--set", s)]]
    result = run_cli(args, tmp_path, jax_free=False)
    err = result.stderr.decode().strip().splitlines()
    assert result.returncode == 2 and len(err) == 1, err
    assert err[0].startswith("error: model.vocab_size: ") and "model.vocab_size=768" in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_deleted_working_folder_is_one_line(tmp_path):
    """The shell's folder deleted under it (a cleaned scratch space): `Path.absolute()` used to raise a traceback."""
    gone = tmp_path / "gone"
    gone.mkdir()
    code = (f"import os, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); from jaxpar.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", code, "train", "--config", TINY, "--run-dir", "run"],
                            capture_output=True, text=True, timeout=120)
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and err == [
        "error: --run-dir: 'run' cannot be used: the working folder was deleted; cd to an existing folder or give an "
        "absolute path; choose another --run-dir"], result.stderr[-2000:]
