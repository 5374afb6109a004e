"""`jaxpar slurm`: an sbatch script for N nodes x G GPUs (or CPU hosts) that survives failures and preemption.

The script (scripts/slurm/train.sbatch is one rendered with the defaults):
- runs one task per node (one JAX process drives all G GPUs of its node: fewer,
  larger processes, the usual choice for JAX) or one task per GPU (`--tasks-per gpu`:
  Slurm binds each task to one GPU, as torchrun-style launchers do);
- starts them with `srun --kill-on-bad-exit=1`: a task that dies takes the step down,
  and jaxpar's excepthook and heartbeat timeout (config `distributed.*`) make sure the
  survivors do not wait minutes for a dead peer;
- asks Slurm for USR1 some seconds before the time limit (`--signal=B:USR1@90`): the
  batch shell passes it to the tasks, which finish the step, save a checkpoint and
  exit 75; the script then requeues the job, whose next start resumes (`--auto-resume`);
- derives the coordinator port from the job id and a step counter, so two concurrent
  steps of one job never collide (JAX's default port depends on the job id only).
"""
from __future__ import annotations

import re
import shlex

from jaxpar.cluster.goodput import ENV_ATTEMPT_START
from jaxpar.config import ConfigError
from jaxpar.env import EXIT_PREEMPTED

PORT_BASE = 20000
# sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]], or no limit.
TIME_LIMIT = re.compile(r"(\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE)")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")   # one word on an #SBATCH line and in the output file name
TEMPLATE = """#!/bin/bash
# jaxpar training job for Slurm, rendered by `jaxpar slurm` (edit the #SBATCH lines for your site).
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={tasks_per_node}
{resource_lines}#SBATCH --time={time}
#SBATCH --output={output}
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@{signal_lead_s}
{extra_sbatch}
set -u
cd {workdir}
RUN_DIR={run_dir}
{env_lines}export {attempt_env}=$(date +%s.%N)
# One coordinator port per job and per srun step: concurrent steps of a job never collide.
STEP_INDEX=${{STEP_INDEX:-0}}
export JAX_COORDINATOR_PORT=$(( {port_base} + (SLURM_JOB_ID % 4000) * 10 + STEP_INDEX ))
{bind_line}
echo "jaxpar: job $SLURM_JOB_ID start ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST, port $JAX_COORDINATOR_PORT"
# Preemption notice (Slurm sends USR1 {signal_lead_s} s before the limit): the tasks save and exit {preempted}.
trap 'echo "jaxpar: USR1: asking the tasks to save and stop"; kill -USR1 "$SRUN_PID" 2>/dev/null' USR1
srun --kill-on-bad-exit=1 --label {srun_options}{command} &
SRUN_PID=$!
wait "$SRUN_PID"; status=$?
while kill -0 "$SRUN_PID" 2>/dev/null; do wait "$SRUN_PID"; status=$?; done   # `wait` returns early on USR1
echo "jaxpar: srun exited with status $status"
if [ "$status" -eq {preempted} ]; then
  echo "jaxpar: preempted after saving; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
"""


def render(*, nodes: int = 2, gpus_per_node: int = 8, tasks_per: str = "node", run_dir: str = "runs/slurm",
           train_args: list[str] | None = None, job_name: str = "jaxpar", time: str = "24:00:00",
           partition: str | None = None, python: str = "python3", workdir: str = "$SLURM_SUBMIT_DIR",
           cpu_devices: int | None = None, signal_lead_s: int = 90, loopback: bool = False,
           output: str | None = None, extra_sbatch: list[str] | None = None,
           tasks_per_node: int | None = None) -> str:
    """The sbatch script text. `cpu_devices`: CPU hosts with that many virtual devices per task (no GPUs);
    `tasks_per_node` overrides the task count `tasks_per` implies (e.g. 2 CPU processes on one test node)."""
    if nodes < 1:
        raise ConfigError("--nodes", f"is {nodes}; must be at least 1")
    if not TIME_LIMIT.fullmatch(time):
        raise ConfigError("--time", f"is {time!r}; give an sbatch time limit: MINUTES, HH:MM:SS or D-HH:MM:SS")
    for field, value in (("--job-name", job_name), ("--partition", partition)):
        if value is not None and not NAME.fullmatch(value):
            raise ConfigError(field, f"is {value!r}; use letters, digits, '.', '_' and '-' (it is written "
                              "into an #SBATCH line)")
    if tasks_per not in ("node", "gpu"):
        raise ConfigError("--tasks-per", f"is '{tasks_per}'; valid: node, gpu")
    if cpu_devices is None and gpus_per_node < 1:
        raise ConfigError("--gpus-per-node", f"is {gpus_per_node}; must be at least 1 (or use --cpu-devices)")
    if cpu_devices is not None and cpu_devices < 1:
        raise ConfigError("--cpu-devices", f"is {cpu_devices}; must be at least 1")
    if tasks_per == "gpu" and cpu_devices is not None:
        raise ConfigError("--tasks-per", "gpu needs GPUs; CPU hosts run one task per node")
    if signal_lead_s < 1:
        raise ConfigError("--signal-lead", f"is {signal_lead_s}; must be at least 1 second")
    if tasks_per_node is not None and tasks_per_node < 1:
        raise ConfigError("--tasks-per-node", f"is {tasks_per_node}; must be at least 1")
    per_gpu = tasks_per == "gpu"
    tasks_per_node = tasks_per_node or (gpus_per_node if per_gpu else 1)
    resources = []
    if cpu_devices is None:
        resources.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
        if per_gpu:
            resources.append("#SBATCH --gpus-per-task=1")
    if partition:
        resources.append(f"#SBATCH --partition={partition}")
    env = []
    args = ["-m", "jaxpar.cli", "train", "--run-dir", '"$RUN_DIR"', "--auto-resume",
            *map(shlex.quote, train_args or [])]
    if cpu_devices is not None:
        env.append("export JAX_PLATFORMS=cpu")
        args += ["--cpu-devices", str(cpu_devices)]
    return TEMPLATE.format(
        job_name=job_name, nodes=nodes, tasks_per_node=tasks_per_node,
        resource_lines="".join(line + "\n" for line in resources), time=time,
        output=output or f"{job_name}-%j.out", signal_lead_s=signal_lead_s,
        extra_sbatch="".join(f"#SBATCH {opt}\n" for opt in extra_sbatch or []).rstrip("\n"),
        workdir=workdir, run_dir=shlex.quote(run_dir) if run_dir else '""',
        env_lines="".join(line + "\n" for line in env), attempt_env=ENV_ATTEMPT_START, port_base=PORT_BASE,
        bind_line=("export JAX_COORDINATOR_BIND_ADDRESS=127.0.0.1:$JAX_COORDINATOR_PORT   # single-node: loopback only"
                   if loopback else "# multi-node: the coordinator listens on the first node of the step"),
        preempted=EXIT_PREEMPTED, srun_options="", command=" ".join([shlex.quote(python), *args]),
    ).replace("\n\nset -u", "\nset -u")


def add_arguments(p) -> None:
    p.add_argument("--nodes", type=int, default=2, help="nodes (hosts) in the job (default: 2)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default: 8)")
    p.add_argument("--tasks-per", choices=("node", "gpu"), default="node",
                   help="one JAX process per node (default) or per GPU")
    p.add_argument("--run-dir", default="runs/slurm", help="run directory on a shared filesystem")
    p.add_argument("--job-name", default="jaxpar")
    p.add_argument("--time", default="24:00:00", help="time limit (sbatch --time)")
    p.add_argument("--partition", help="sbatch --partition")
    p.add_argument("--python", default="python3", help="the Python that has jaxpar installed")
    p.add_argument("--cpu-devices", type=int, help="CPU hosts with N virtual devices per task (tests, no GPUs)")
    p.add_argument("--tasks-per-node", type=int, help="override the tasks per node (e.g. 2 CPU processes on 1 node)")
    p.add_argument("--signal-lead", type=int, default=90, help="seconds before the limit to save (default: 90)")
    p.add_argument("--loopback", action="store_true", help="single-node clusters: keep the coordinator on 127.0.0.1")
    p.add_argument("--out", help="write the script to this file instead of printing it")
    p.add_argument("train_args", nargs="*", help="arguments for `jaxpar train` after `--`, e.g. -- --config FILE")


def run_from_args(args) -> int:
    from jaxpar.cluster.train_args import check_train_args
    check_train_args([a for a in args.train_args if a != "--"])
    text = render(nodes=args.nodes, gpus_per_node=args.gpus_per_node, tasks_per=args.tasks_per,
                  run_dir=args.run_dir, train_args=[a for a in args.train_args if a != "--"],
                  job_name=args.job_name, time=args.time, partition=args.partition, python=args.python,
                  cpu_devices=args.cpu_devices, signal_lead_s=args.signal_lead, loopback=args.loopback,
                  tasks_per_node=args.tasks_per_node)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}; submit it with: sbatch {args.out}")
    else:
        print(text, end="")
    return 0
