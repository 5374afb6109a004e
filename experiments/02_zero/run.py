"""Lab 02 (ZeRO): `python experiments/02_zero/run.py --cpu-devices 8 --out DIR`; the code is jaxpar/labs/zero/lab.py."""
import sys

from jaxpar.labs.zero.lab import main

if __name__ == "__main__":
    sys.exit(main())
