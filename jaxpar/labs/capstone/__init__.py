"""Lab 10: the capstone plan, checked by compiles and CPU runs (lab.py runs it; sheet, plots)."""
