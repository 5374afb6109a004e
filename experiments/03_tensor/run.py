"""Lab 03: `python experiments/03_tensor/run.py --cpu-devices 8 --out DIR`;
the code is jaxpar/labs/tensor/lab.py."""
import sys

from jaxpar.labs.tensor.lab import main

if __name__ == "__main__":
    sys.exit(main())
