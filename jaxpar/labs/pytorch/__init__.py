"""Lab 06: the same model in PyTorch and jaxpar (lab.py runs it; pairs, sheet, jax_side and the torch_* side)."""
