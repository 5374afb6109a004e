"""Lab 07: Mixture-of-Experts and expert parallelism (lab.py runs it; build, layouts, plots)."""
