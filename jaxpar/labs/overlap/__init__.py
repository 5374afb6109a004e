"""Lab 05: communication hidden behind computation (lab.py runs it)."""
