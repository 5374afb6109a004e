"""Tests run on 8 virtual CPU devices; subprocesses share one tokenizer cache per session."""
import os
import tempfile

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
os.environ.setdefault("JAXPAR_CACHE", tempfile.mkdtemp(prefix="jaxpar-test-cache-"))

# Under pytest-xdist (`-n 2 --dist loadgroup`, as .ci/run runs) each test file stays on one worker, so its
# module fixtures are built once. The files that start the local Slurm cluster share one worker: each cluster
# starts and stops the one munged of the machine.
SHARED_WORKER = {"test_slurm": "slurm-cluster", "test_plan_sweep": "slurm-cluster"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.path.stem
        item.add_marker(pytest.mark.xdist_group(SHARED_WORKER.get(module, module)))
