"""Damaged checkpoints, as an operator's disk damages them, and bad numbers.

A reference run saves steps 4 and 8. Each test damages a copy of it and resumes:
the run falls back to step 4 with one line and then reproduces the reference's
losses exactly, or, when no step is intact, exits 2 with one line. A run whose loss
turns non-finite exits non-zero and keeps its good checkpoints.
"""
import os
import shutil
import struct
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from ops_helpers import children_share_a_compilation_cache, losses, reference  # noqa: F401 (fixtures)

from jaxpar.cli import main
from jaxpar.train.checkpoint import read_quietly
from jaxpar.train.guard import EXIT_NON_FINITE

# Orbax's abandoned reads of a failed restore must not surface after the one-line report.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


def array_files(run_dir, step):
    """The data files holding a step's arrays, largest first."""
    files = [p for p in (run_dir / "checkpoints" / str(step) / "state").rglob("*")
             if p.is_file() and p.parent.name == "d"]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def damaged_copy(reference, tmp_path, damage, steps=(8,), every_file=False):
    """A copy of the reference run whose `steps` have their largest array file damaged (`every_file`: all of
    them: where TensorStore's layout leaves the damaged half of one file unread, the step still restores)."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    for step in steps:
        files = array_files(run_dir, step)
        for path in files if every_file else files[:1]:
            damage(path)
    return run_dir


def overwrite_at(path, fraction, floats=500):
    with open(path, "r+b") as f:
        f.seek(int(path.stat().st_size * fraction))
        f.write(struct.pack("<f", 0.5) * floats)


def plain_restore(checkpoint, abstract):
    """The state as Orbax alone restores it (no checksums); raises where the files do not decode."""
    manager = ocp.CheckpointManager(checkpoint.parent, item_names=("state", "meta"))
    try:
        restored, failure = read_quietly(lambda: manager.restore(
            int(checkpoint.name), args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))))
        if failure:
            raise ValueError(failure)
        return [np.asarray(x) for x in jax.tree.leaves(restored["state"])]
    finally:
        manager.close()


def overwrite(path):
    """Bytes overwritten in place (size unchanged) where Orbax still restores, with wrong values, silently.

    Where the bytes land depends on how TensorStore laid the arrays out (it varies from run to run):
    some places break the file's framing (then it is `truncate`'s case), some hold no live data. Each
    place is tried on a scratch copy with a plain Orbax restore, compared with the undamaged values:
    2,000 bytes first, then a single float, which fits between the framing where a long write cannot.
    """
    checkpoint = next(p for p in path.parents if p.parent.name == "checkpoints")   # <run>/checkpoints/<step>
    abstract = abstract_state(checkpoint.parent.parent)
    intact = plain_restore(checkpoint, abstract)
    scratch = checkpoint.parent.parent.parent / "scratch" / "checkpoints" / checkpoint.name
    others = [f for f in array_files(checkpoint.parent.parent, checkpoint.name) if f != path]
    places = [(target, fraction, floats) for floats in (500, 1)
              for target in [path, *others]     # the largest file first; another where its layout leaves no place
              for fraction in np.linspace(0.95, 0.05, 19)]
    for target, fraction, floats in places:
        shutil.rmtree(scratch.parent, ignore_errors=True)
        shutil.copytree(checkpoint, scratch)
        overwrite_at(scratch / target.relative_to(checkpoint), fraction, floats)
        try:
            damaged = plain_restore(scratch, abstract)
        except Exception:  # noqa: BLE001 - this place breaks the framing: try another
            continue
        finally:
            shutil.rmtree(scratch.parent, ignore_errors=True)
        if any(not np.array_equal(a, b) for a, b in zip(intact, damaged)):
            overwrite_at(target, fraction, floats)
            return
    pytest.fail("no place found where overwritten bytes still restore")


def abstract_state(run_dir):
    from jaxpar.mesh import make_mesh
    from jaxpar.model.transformer import ModelConfig
    from jaxpar.parallel.registry import make_strategy
    from jaxpar.train.rundir import resume_config
    config = resume_config(run_dir)
    model_cfg = ModelConfig.from_config(config.model, 512)   # configs/test.py's 512-token BPE vocabulary
    return make_strategy(config, model_cfg, make_mesh(config, jax.devices())).canonical_abstract_state


def truncate(path):
    os.truncate(path, path.stat().st_size // 2)


def delete(path):
    path.unlink()


@pytest.mark.parametrize("damage, reason", [(overwrite, "checksum mismatch"), (truncate, "unreadable"),
                                            (delete, "unreadable")], ids=["overwritten", "truncated", "deleted"])
def test_a_damaged_step_falls_back_to_the_last_good_one(reference, tmp_path, capsys, damage, reason):
    run_dir = damaged_copy(reference, tmp_path, damage, every_file=damage is truncate)
    if damage is delete:   # as a user runs it: Orbax's background threads must not print at exit either
        result = subprocess.run([sys.executable, "-m", "jaxpar.cli", "train", "--run-dir", str(run_dir), "--resume",
                                 "--cpu-devices", "8"], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        out = result.stdout
        for text in ("Traceback", "Event loop is closed", "cannot schedule new futures"):
            assert text not in result.stdout + result.stderr, (result.stdout + result.stderr)[-3000:]
    else:
        assert main(["train", "--run-dir", str(run_dir), "--resume"]) == 0
        out = capsys.readouterr().out
    notices = [line for line in out.splitlines() if line.startswith("checkpoint step 8 is")]
    assert len(notices) == 1 and reason in notices[0], out
    assert "resumed from step 4" in out
    assert (run_dir / "damaged-checkpoints" / "8").is_dir()      # kept for inspection, out of the way
    resumed, expected = losses(run_dir), losses(reference)
    assert [resumed[s] for s in range(5, 9)] == [expected[s] for s in range(5, 9)]   # exactly


def test_every_step_damaged_is_one_line_and_exit_2(reference, tmp_path, capsys):
    run_dir = damaged_copy(reference, tmp_path, truncate, steps=(4, 8), every_file=True)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    result = subprocess.run([sys.executable, "-m", "jaxpar.cli", "train", "--run-dir", str(run_dir), "--resume",
                             "--cpu-devices", "8"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"error: --resume: no intact checkpoint in '{run_dir / 'checkpoints'}' (every step is damaged or "
        "unreadable); start a new run"], result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stdout.count(" is unreadable (") == 2
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before   # nothing moved or deleted
    assert main(["sample", "--run-dir", str(run_dir), "--max-tokens", "8"]) == 2     # `jaxpar sample` too
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --run-dir: no readable checkpoint in '{run_dir / 'checkpoints'}'"]


def test_an_exploding_update_is_never_saved_and_the_good_checkpoints_stay(reference, tmp_path, capsys):
    run_dir = damaged_copy(reference, tmp_path, lambda path: None, steps=())
    # A huge learning rate blows the parameters up in step 9's update (its loss and gradient norm are still
    # finite). Saving every step with keep_checkpoints=2, a saved step 9 would rotate step 4 away, and a
    # resume would start from the exploded state.
    code = main(["train", "--run-dir", str(run_dir), "--resume", "--set", "train.steps=16",
                 "--set", "train.lr=1e30", "--set", "train.keep_checkpoints=2", "--set", "train.checkpoint_every=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_NON_FINITE
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [4, 8]
    assert len(err) == 1 and err[0].startswith("train: ") and "stopped without saving" in err[0], err
    assert "the state after step 9 has exploded" in err[0], err
    assert main(["train", "--run-dir", str(run_dir), "--resume", "--set", "train.lr=0.01",   # step 8 is intact
                 "--set", "train.steps=10"]) == 0
    assert "resumed from step 8" in capsys.readouterr().out


def test_bad_steps_are_skipped_up_to_max_bad_steps(tmp_path, capsys, monkeypatch):
    """Step 3 of the run turns every float of the state (and the loss) into NaN; with max_bad_steps=1 the
    loop undoes that step and trains on from the state before it, finite to the end."""
    import jax.numpy as jnp

    import jaxpar.training as loop
    build = loop.make_strategy

    def poisoned(*args, **kwargs):
        strategy = build(*args, **kwargs)
        step, calls = strategy.step, []

        def step_going_bad_once(state, batch):
            calls.append(1)
            state, metrics = step(state, batch)
            if len(calls) == 3:
                state = jax.tree.map(lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
                metrics = {**metrics, "loss": metrics["loss"] * jnp.nan}
            return state, metrics

        strategy.step = step_going_bad_once
        return strategy

    monkeypatch.setattr(loop, "make_strategy", poisoned)
    run_dir = tmp_path / "run"
    assert main(["train", "--config", "configs/test.py", "--set", "train.sample_tokens=0", "--run-dir", str(run_dir),
                 "--set", "train.max_bad_steps=1"]) == 0
    assert "step 3: non-finite loss or gradient norm; update skipped (1/1 allowed)" in capsys.readouterr().out
    trained = losses(run_dir)
    assert np.isnan(trained[3]) and all(np.isfinite(trained[s]) for s in trained if s != 3)
    assert trained[8] < trained[1]
