"""Lab 03: Megatron tensor and sequence parallelism by hand (lab.py runs it; build, context, plots)."""
