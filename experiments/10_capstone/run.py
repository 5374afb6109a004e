"""Lab 10 (capstone): `python experiments/10_capstone/run.py --out DIR`; the code is jaxpar/labs/capstone/lab.py."""
import sys

from jaxpar.labs.capstone.lab import main

if __name__ == "__main__":
    sys.exit(main())
