"""Lab 05: `python experiments/05_overlap/run.py --cpu-devices 8 --out DIR`; the code is jaxpar/labs/overlap/lab.py."""
import sys

from jaxpar.labs.overlap.lab import main

if __name__ == "__main__":
    sys.exit(main())
