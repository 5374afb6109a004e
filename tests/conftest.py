"""Tests run on 8 virtual CPU devices; subprocesses share one tokenizer cache per session.

XLA:CPU compiles at LLVM -O0 here (this process and, through the environment, every child): the HLO, and so
every collective and buffer the tests check, is the same, and the suite is compile-bound (-O0 compiles about
2.5x faster). Runs outside the tests compile at XLA's default level.
"""
import os
import tempfile

os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]))

import jax  # noqa: E402  (XLA_FLAGS first: XLA reads them when the backend starts)
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
os.environ.setdefault("JAXPAR_CACHE", tempfile.mkdtemp(prefix="jaxpar-test-cache-"))


# The tests that start a local Slurm cluster share one munged: under `pytest -n 2` (.ci/run) they run on one worker.
SLURM_MODULES = {"test_slurm", "test_plan_sweep", "test_journeys"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's --dist loadgroup, each test file runs whole on one worker (its module fixtures, such as a
    reference run, are computed once), and the Slurm files together on one. A test that names its own group keeps
    it (each lab's journey, tests/test_journeys.py: two labs run at once, one on each worker)."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        module = item.module.__name__ if item.module else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group("slurm" if module in SLURM_MODULES else module))
