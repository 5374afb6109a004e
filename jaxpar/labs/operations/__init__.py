"""Lab 09: failure and reshard drills (lab.py runs it)."""
