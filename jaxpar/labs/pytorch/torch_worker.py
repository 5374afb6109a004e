"""The PyTorch side of lab 06 as its own program: N local CPU processes joined by torch.distributed (gloo),
one rank per process, training every requested strategy from the same initial weights on the same batches.

`python -m jaxpar.labs.pytorch.torch_worker SPEC.json OUT_DIR` (the lab writes SPEC: the Hugging Face export
of jaxpar's initial weights, the token batches, jaxpar's optimizer as numbers, the strategies, N).
Rank 0 first trains the model alone (the one-device oracle, no process group traffic) while the
others wait; then every rank runs each strategy in turn. Each rank writes OUT_DIR/torch-rank<r>.json.
A separate program because torch.multiprocessing's spawn re-imports its parent, and the lab's
parent process has JAX started.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def run_rank(rank: int, spec: dict, out: str) -> None:
    import torch
    import torch.distributed as dist

    from jaxpar.labs.pytorch import torch_llama, torch_parallel
    from jaxpar.labs.pytorch.torch_train import Hyper, train

    torch.set_num_threads(1)                    # one core's worth per rank: N ranks share the machine
    n = spec["processes"]
    # parallel: setup
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    # end parallel
    batches = [torch.from_numpy(b.astype(np.int64)) for b in np.load(spec["batches"])["batches"]]
    hp = Hyper(**spec["hyper"])
    results: dict[str, Any] = {}
    if rank == 0 and spec["check_transformers"]:   # our torch module against LlamaForCausalLM, same weights
        results["_transformers_max_abs_logit_dev"] = torch_llama.transformers_deviation(
            spec["hf_dir"], batches[0][:, :-1])
    for key in spec["strategies"]:
        dist.barrier()
        torch.manual_seed(0)
        model = torch_llama.load(spec["hf_dir"])
        if key == "single":
            if rank == 0:
                results[key] = train(torch_parallel.single(model), batches, hp, world=1,
                                     profile_step=spec["profile_step"])
            continue
        if key in ("gpipe", "1f1b"):
            parallel = torch_parallel.pipeline(model, key, spec["microbatches"])
        else:
            parallel = torch_parallel.STRATEGIES[key](model)
        start = time.perf_counter()
        results[key] = train(parallel, batches, hp, world=n, profile_step=spec["profile_step"],
                             dtensor=key in spec.get("comm_debug_mode", ()))
        results[key]["seconds"] = time.perf_counter() - start
    dist.barrier()
    results["_process"] = {"rank": rank, "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                           "torch": torch.__version__}
    Path(out, f"torch-rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main(argv=None) -> int:
    import torch.multiprocessing as mp
    spec_path, out = argv or sys.argv[1:]
    spec = json.loads(Path(spec_path).read_text())
    mp.spawn(run_rank, args=(spec, out), nprocs=spec["processes"], join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
