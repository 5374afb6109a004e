"""Lab 06: `python experiments/06_pytorch/run.py --out DIR`; the code is jaxpar/labs/pytorch.py."""
import sys

from jaxpar.labs.pytorch import main

if __name__ == "__main__":
    sys.exit(main())
