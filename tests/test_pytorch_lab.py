"""Lab 08's promise at its smallest: PyTorch DDP on 2 gloo processes, fed jaxpar's batches, initial weights and
optimizer, trains to the same losses as jaxpar's hand-written DDP on 2 devices (fp32, 3 steps)."""
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

pytest.importorskip("torch")

from jaxpar.config import load_config  # noqa: E402
from jaxpar.data.pipeline import build_token_data  # noqa: E402
from jaxpar.labs import pytorch as lab  # noqa: E402
from jaxpar.labs.pytorch_jax import run_variants  # noqa: E402
from jaxpar.labs.report import max_rel_dev  # noqa: E402

CONFIG = "configs/test.py"
STEPS = 3


def test_torch_ddp_losses_equal_jaxpar_ddp(tmp_path):
    config = load_config(CONFIG)
    config, inputs = lab.prepare(config, build_token_data(config.data), STEPS, tmp_path)
    batches = list(np.load(inputs["batches"])["batches"])
    jaxpar = run_variants(config, batches, {"ddp": ["mesh.data=2", "parallel.data=ddp"]}, log=lambda _: None)
    torch_side = lab.run_torch(inputs, ["ddp"], 2, 2, tmp_path, check_transformers=False)
    want = jaxpar["ddp"]["losses"]
    got = [rank["ddp"]["losses"] for rank in torch_side["ranks"]]
    assert len(want) == STEPS and want[-1] < want[0]               # it trained: the comparison means something
    assert got[0] == got[1]                                        # every rank reports the global mean
    assert max_rel_dev(got[0], want) <= lab.TOLERANCE, (got[0], want)
    psi = sum(t.size for t in load_file(Path(inputs["hf_dir"]) / "model.safetensors").values())
    sent = torch_side["ranks"][0]["ddp"]["trace"]["sent"]["all-reduce"]
    assert 4 * psi <= sent <= 4 * psi + 64                         # 2(N-1)/N·4Ψ, + the loss's 4 bytes
