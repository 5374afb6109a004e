"""Child of tests/test_pipeline.py: `python -m pipeline_worker all --cpu-devices M`.

Joins the job `jaxpar launch` sets up and trains each pipeline case for a few steps on
one global mesh spanning all processes; process 0 prints `LOSSES <name> <json>`.
"""
from __future__ import annotations

import sys

from strategies_worker import train_and_print

CASES = {
    "1f1b-pipe4-tensor2": ["mesh.data=1", "mesh.pipe=4", "mesh.tensor=2", "parallel.pipe=1f1b",
                           "parallel.pipe_microbatches=8"],
    "3d-data2-pipe2-tensor2": ["mesh.data=2", "mesh.pipe=2", "mesh.tensor=2", "parallel.pipe=1f1b",
                               "parallel.pipe_microbatches=4"],
}


def main(argv: list[str]) -> int:
    return train_and_print(argv, CASES, common=("model.layers=4",))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
