"""The course labs' code: `jaxpar lab <name>` and `experiments/<NN>_<name>/run.py` both call it.

The code lives in the package (not in experiments/, which is not installed) so that
`jaxpar lab` works from any install; each experiments/ folder keeps its lab sheet
(README.md) and a run.py that is a thin wrapper around `main`.
"""
