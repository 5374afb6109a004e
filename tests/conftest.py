"""Tests run on 8 virtual CPU devices; subprocesses share one tokenizer cache per session."""
import os
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)
os.environ.setdefault("JAXPAR_CACHE", tempfile.mkdtemp(prefix="jaxpar-test-cache-"))

