"""Lab 04: pipeline schedules (lab.py runs it; build, timeline, moe, plots)."""
