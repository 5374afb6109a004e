"""Lab 04 (pipeline): `python experiments/04_pipeline/run.py --cpu-devices 8 --out DIR`;
the code is jaxpar/labs/pipeline/lab.py."""
import sys

from jaxpar.labs.pipeline.lab import main

if __name__ == "__main__":
    sys.exit(main())
