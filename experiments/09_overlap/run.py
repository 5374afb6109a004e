"""Lab 09: `python experiments/09_overlap/run.py --cpu-devices 8 --out DIR`; the code is jaxpar/labs/overlap.py."""
import sys

from jaxpar.labs.overlap import main

if __name__ == "__main__":
    sys.exit(main())
