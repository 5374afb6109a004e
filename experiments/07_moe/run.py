"""Lab 07 (MoE): `python experiments/07_moe/run.py --cpu-devices 8 --out DIR`; the code is jaxpar/labs/moe/lab.py."""
import sys

from jaxpar.labs.moe.lab import main

if __name__ == "__main__":
    sys.exit(main())
