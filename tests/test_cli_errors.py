"""Bad input: exit status 2, one line naming the field and what is valid, no traceback, nothing overwritten."""
import subprocess
import sys

import pytest

from jaxpar.cli import main

TINY = ["--config", "configs/test.py"]


def run_main(capsys, argv):
    """Run the CLI in-process; return (exit status, stderr lines)."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse errors
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


@pytest.mark.parametrize("extra, field", [
    (["--set", "model.layrs=4"], "model.layrs"),
    (["--set", "model.layers=four"], "model.layers"),
    (["--set", "mesh.data=3"], "mesh"),
    (["--set", "mesh.data=1", "--set", "mesh.tensor=8"], "model.heads"),
    (["--set", "model.kv_heads=3"], "model.kv_heads"),
    (["--set", "train.batch_size=12"], "train.batch_size"),
    (["--set", "data.corpus=/no/such/corpus.txt"], "data.corpus"),
    (["--set", "mesh.expert=2", "--set", "mesh.data=4"], "mesh.expert"),
    (["--config", "configs/no_such.py"], "--config"),
    (["--set", "parallel.data=zero9"], "parallel.data"),
    (["--set", "mesh.data=1", "--set", "mesh.fsdp=8", "--set", "parallel.data=zero2"], "parallel.data"),
    (["--set", "parallel.rules=length=nowhere"], "parallel.rules"),
    (["--set", "parallel.rules=sequence=tensor"], "parallel.rules"),
    (["--set", "parallel.rules=heads=tensor,head_dim=tensor", "--set", "mesh.data=4",
      "--set", "mesh.tensor=2"], "parallel.rules"),
    (["--cpu-devices", "0"], "--cpu-devices"),
    (["--cpu-devices", "-3"], "--cpu-devices"),
])
def test_bad_train_input(capsys, tmp_path, extra, field):
    code, err = run_main(capsys, ["train", *TINY, "--run-dir", str(tmp_path / "run"), *extra])
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"error: {field}: "), err
    assert not (tmp_path / "run").exists()                  # nothing was created


def test_config_file_that_fails_to_load(capsys, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def get_config(:\n    pass\n")
    code, err = run_main(capsys, ["train", "--config", str(broken), "--run-dir", str(tmp_path / "run")])
    assert code == 2 and err == [f"error: --config: '{broken}' line 1: invalid syntax"], err
    raising = tmp_path / "raising.py"
    raising.write_text("def get_config():\n    return 1 / 0\n")
    code, err = run_main(capsys, ["train", "--config", str(raising), "--run-dir", str(tmp_path / "run")])
    assert code == 2 and len(err) == 1 and "ZeroDivisionError" in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_unwritable_run_dir_is_refused_before_anything_is_built(capsys, tmp_path, where):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    run_dir = a_file / "run" if where == "under-a-file" else "/proc/jaxpar-run"
    code, err = run_main(capsys, ["train", *TINY, "--run-dir", str(run_dir)])
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: --run-dir: '{run_dir}' cannot be written")


def test_empty_corpus(capsys, tmp_path):
    corpus = tmp_path / "empty.txt"
    corpus.write_text("")
    code, err = run_main(capsys, ["train", *TINY, "--run-dir", str(tmp_path / "run"),
                                  "--set", f"data.corpus={corpus}"])
    assert code == 2 and err == [f"error: data.corpus: '{corpus}' holds no text"]


def test_resume_without_checkpoint(capsys, tmp_path):
    code, err = run_main(capsys, ["train", *TINY, "--run-dir", str(tmp_path / "nothing"), "--resume"])
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --resume: no checkpoint")
    code, err = run_main(capsys, ["train", *TINY, "--resume"])
    assert code == 2 and err[0].startswith("error: --resume: needs --run-dir")


def test_argparse_errors_are_one_line(capsys):
    code, err = run_main(capsys, ["train", "--resume", "--overwrite", "--run-dir", "x"])
    assert code == 2 and len(err) == 1 and "not allowed with" in err[0]
    code, err = run_main(capsys, ["trian"])
    assert code == 2 and len(err) == 1


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    short = ["--set", "train.steps=4", "--set", "train.sample_tokens=0"]
    assert main(["train", *TINY, "--run-dir", str(run_dir), *short]) == 0
    return run_dir


def snapshot(run_dir):
    return {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def test_existing_run_dir_is_never_overwritten(capsys, finished_run):
    before = snapshot(finished_run)
    code, err = run_main(capsys, ["train", *TINY, "--run-dir", str(finished_run)])
    assert code == 2 and len(err) == 1 and "--resume" in err[0] and "--overwrite" in err[0]
    assert snapshot(finished_run) == before


@pytest.mark.parametrize("extra, field", [
    (["--set", "model.d_model=128"], "model.d_model"),
    (["--set", "data.seq_len=16"], "data.seq_len"),
    (["--set", "train.batch_size=32"], "train.batch_size"),
])
def test_resume_with_changed_shapes(capsys, finished_run, extra, field):
    before = snapshot(finished_run)
    code, err = run_main(capsys, ["train", "--run-dir", str(finished_run), "--resume", *extra])
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {field}: "), err
    assert snapshot(finished_run) == before


def test_subprocess_exit_status_and_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "jaxpar.cli", "train", *TINY, "--run-dir", str(tmp_path / "r"),
                             "--cpu-devices", "8", "--set", "model.heads=8", "--set", "model.kv_heads=3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == "error: model.kv_heads: kv_heads=3 must divide heads=8"


def test_sample_bad_input(capsys, tmp_path, finished_run):
    code, err = run_main(capsys, ["sample", "--run-dir", str(tmp_path / "none")])
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --run-dir: ")
    code, err = run_main(capsys, ["sample", "--run-dir", str(finished_run), "--max-tokens", "0"])
    assert code == 2 and err[0].startswith("error: --max-tokens: ")
    code, err = run_main(capsys, ["sample", "--run-dir", str(finished_run), "--prompt", "ٱللَّهِ " * 40])
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --prompt: encodes to "), err


def test_sample_says_when_max_tokens_is_reduced(capsys, finished_run):
    code, err = run_main(capsys, ["sample", "--run-dir", str(finished_run), "--max-tokens", "5000"])
    assert code == 0 and len(err) == 1 and err[0].startswith("note: --max-tokens 5000 does not fit"), err
