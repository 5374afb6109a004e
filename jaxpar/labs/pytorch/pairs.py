"""Lab 06's pairing: each PyTorch strategy beside jaxpar's automatic and hand-written one, and the lines a
PyTorch user writes per strategy (counted from the torch side's code)."""
from __future__ import annotations

import re
from pathlib import Path

TOLERANCE = 1e-4
REPO = Path(__file__).resolve().parents[3]
TORCH_CODE = (Path(__file__).with_name("torch_parallel.py"), Path(__file__).with_name("torch_worker.py"))

# key: (PyTorch API, torch strategy, jaxpar automatic, jaxpar hand-written); {n}, {m}: processes, microbatches
PAIRS = {
    "ddp": ("DistributedDataParallel", "ddp", ["mesh.data={n}"], ["mesh.data={n}", "parallel.data=ddp"]),
    "fsdp2": ("fully_shard (FSDP2)", "fsdp2", ["mesh.fsdp={n}"], ["mesh.data={n}", "parallel.data=zero3"]),
    "tp": ("parallelize_module: ColwiseParallel / RowwiseParallel", "tp", ["mesh.tensor={n}"],
           ["mesh.tensor={n}", "parallel.tensor=manual"]),
    "tp-sp": ("... + SequenceParallel", "tp-sp", ["mesh.tensor={n}", "parallel.rules=length=tensor"],
              ["mesh.tensor={n}", "parallel.tensor=manual", "parallel.sequence=true"]),
    "gpipe": ("pipelining: ScheduleGPipe", "gpipe",
              ["mesh.pipe={n}", "parallel.pipe=circular", "parallel.pipe_microbatches={m}"],
              ["mesh.pipe={n}", "parallel.pipe=gpipe", "parallel.pipe_microbatches={m}"]),
    "1f1b": ("pipelining: Schedule1F1B", "1f1b", None,
             ["mesh.pipe={n}", "parallel.pipe=1f1b", "parallel.pipe_microbatches={m}"]),
}




def code_lines(paths=TORCH_CODE) -> dict[str, int]:
    """Lines a PyTorch user writes per strategy: between `# parallel: NAME` and `# end parallel` (every
    block of that name) in torch_parallel.py, and the process group's (`setup`) in torch_worker.py;
    blank and comment-only lines left out."""
    counts: dict[str, int] = {}
    name = None
    for line in (line for path in paths for line in path.read_text().splitlines()):
        marker = re.match(r"\s*# parallel: (\S+)", line)
        if marker:
            name = marker.group(1)
            counts.setdefault(name, 0)
        elif re.match(r"\s*# end parallel", line):
            name = None
        elif name and line.strip() and not line.strip().startswith("#"):
            counts[name] += 1
    return counts
