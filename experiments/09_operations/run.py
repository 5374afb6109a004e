"""Lab 09 (operations): `python experiments/09_operations/run.py --out DIR`; the code is jaxpar/labs/operations.py."""
import sys

from jaxpar.labs.operations import main

if __name__ == "__main__":
    sys.exit(main())
