"""Lab 08: fused kernels and compilation (lab.py runs it; strategies)."""
