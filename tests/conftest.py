"""Tests run on 8 virtual CPU devices; subprocesses share one tokenizer cache per session.

XLA:CPU compiles at LLVM -O0 here (this process and, through the environment, every child): the HLO, and so
every collective and buffer the tests check, is the same, and the suite is compile-bound (-O0 compiles about
2.5x faster). Runs outside the tests compile at XLA's default level.
"""
import os
import tempfile

os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]))

import jax  # noqa: E402  (XLA_FLAGS first: XLA reads them when the backend starts)

jax.config.update("jax_num_cpu_devices", 8)
os.environ.setdefault("JAXPAR_CACHE", tempfile.mkdtemp(prefix="jaxpar-test-cache-"))
