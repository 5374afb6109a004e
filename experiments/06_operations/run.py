"""Lab 06 (operations): `python experiments/06_operations/run.py --out DIR`; the code is jaxpar/labs/ops.py."""
import sys

from jaxpar.labs.ops import main

if __name__ == "__main__":
    sys.exit(main())
