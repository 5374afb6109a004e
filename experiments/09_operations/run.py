"""Lab 09 (operations): `python experiments/09_operations/run.py --out DIR`;
the code is jaxpar/labs/operations/lab.py."""
import sys

from jaxpar.labs.operations.lab import main

if __name__ == "__main__":
    sys.exit(main())
