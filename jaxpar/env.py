"""What a launcher and the processes it starts agree on: environment variable names and exit codes.

`jaxpar launch`, the Slurm script and the Kubernetes manifests set these variables and read
these statuses; keeping them here (no JAX import) lets those commands start in a fraction of
a second.
"""

# Environment the local launcher and the Kubernetes pods set for each process (jaxpar/mesh.py reads it).
ENV_COORDINATOR = "JAXPAR_COORDINATOR"
ENV_NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPAR_PROCESS_ID"

EXIT_BAD_INPUT = 2    # a configuration error: restarting cannot help
EXIT_PREEMPTED = 75   # EX_TEMPFAIL: "try again later"; saved after a preemption notice, the Slurm script requeues
