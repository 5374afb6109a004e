"""Lab 06: `python experiments/06_pytorch/run.py --out DIR`; the code is jaxpar/labs/pytorch/lab.py."""
import sys

from jaxpar.labs.pytorch.lab import main

if __name__ == "__main__":
    sys.exit(main())
