"""What context parallelism sends per step (the builder: parallel/context.py)."""
from __future__ import annotations

from jaxpar.parallel import auto
from jaxpar.parallel.theory import Candidate, Prediction


def predict(shape, cand: Candidate, global_batch: int, seq_len: int, platform: str) -> Prediction:
    return auto.predict(shape, cand, global_batch, seq_len, platform)
