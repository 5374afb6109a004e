"""Shared pieces of the operations tests (module 6): losses of a run, and a compilation cache for children.

Child processes (launches, Slurm tasks, CLI runs) of one test module compile the same
programs again and again; JAX's persistent compilation cache, shared through the
environment, turns every compile after the first into a cache read.
"""
import json
import os
import shutil

import pytest

from jaxpar.cli import main

TINY = ["--config", "configs/test.py", "--set", "train.sample_tokens=0"]


def losses(run_dir) -> dict[int, float]:
    """{step: loss} from a run's metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The oracle run of the operations tests: configs/test.py, 1 process x 8 devices, checkpoints at 4 and 8.

    Made once per session (the first module that asks) and shared read-only: tests copy it before changing it.
    """
    run_dir = tmp_path_factory.getbasetemp() / "ops-reference"
    if not (run_dir / "summary.json").is_file():
        shutil.rmtree(run_dir, ignore_errors=True)
        assert main(["train", *TINY, "--run-dir", str(run_dir)]) == 0
    return run_dir


@pytest.fixture(scope="module", autouse=True)
def children_share_a_compilation_cache(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("jax-compilation-cache"))
    previous = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = directory
    yield directory
    if previous is None:
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    else:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = previous
