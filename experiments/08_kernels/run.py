"""Lab 08 (kernels): `python experiments/08_kernels/run.py --cpu-devices 8 --out DIR`;
the code is jaxpar/labs/kernels/lab.py."""
import sys

from jaxpar.labs.kernels.lab import main

if __name__ == "__main__":
    sys.exit(main())
