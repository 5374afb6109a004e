"""`jaxpar k8s`: Kubernetes manifests for N hosts x G GPUs, one JAX process per pod.

Two forms, both with the same pod:
- a JobSet (jobset.x-k8s.io/v1alpha2, the form MaxText's XPK and GKE use): one
  replicated Job of N indexed pods; JobSet creates the headless Service that gives
  each pod a DNS name, and `failurePolicy.maxRestarts` recreates every pod when one
  fails (the counterpart of `jaxpar launch --max-restarts`);
- an Indexed Job plus a headless Service, for clusters without the JobSet controller.

Each pod learns its place from its completion index: JAXPAR_PROCESS_ID comes from the
pod annotation `batch.kubernetes.io/job-completion-index`, JAXPAR_NUM_PROCESSES is N, and
JAXPAR_COORDINATOR is pod 0's DNS name; jaxpar.mesh.init_distributed turns these into
`jax.distributed.initialize` arguments. Checkpoints go to a shared volume (a
PersistentVolumeClaim mounted at /checkpoints, emitted first unless `--existing-claim`
names one already there), and `--auto-resume` makes every restarted pod continue from
the last one. SIGTERM before the grace period ends is a
preemption notice: the pods save and exit 75.
"""
from __future__ import annotations

import re
import shlex

import yaml

from jaxpar.config import ConfigError
from jaxpar.env import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

COORDINATOR_PORT = 8476
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
CHECKPOINT_MOUNT = "/checkpoints"
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")        # RFC 1035 label: Service, Job and pod names
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
CLAIM_SIZE = "100Gi"
QUANTITY = re.compile(r"\d+(\.\d+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")   # a storage request, e.g. 100Gi


def _container(name, image, hosts, gpus, coordinator, train_args, run_dir, cpu_devices):
    command = ["python3", "-m", "jaxpar.cli", "train", "--run-dir", run_dir, "--auto-resume", *train_args]
    if cpu_devices:
        command += ["--cpu-devices", str(cpu_devices)]
    env = [
        {"name": ENV_PROCESS_ID,
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}},
        {"name": ENV_NUM_PROCESSES, "value": str(hosts)},
        {"name": ENV_COORDINATOR, "value": f"{coordinator}:{COORDINATOR_PORT}"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    container = {
        "name": name, "image": image, "command": ["bash", "-c", shlex.join(command)], "env": env,
        "ports": [{"containerPort": COORDINATOR_PORT, "name": "coordinator"}],
        "volumeMounts": [{"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT}],
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}   # a Quantity
    return container


def _pod_spec(container, claim, service=None):
    spec = {
        "restartPolicy": "Never",                 # a failed pod fails its Job; JobSet/the user restarts all
        "terminationGracePeriodSeconds": 120,     # SIGTERM -> save a checkpoint -> exit 75
        "containers": [container],
        "volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}}],
    }
    if service:
        spec["subdomain"] = service               # pod DNS: <hostname>.<service>
    return spec


def _check_names(name: str, hosts: int, kind: str, image: str, claim: str, claim_size: str, namespace) -> None:
    """Names Kubernetes accepts (and whose longest pod hostname fits 63 characters); an image to pull."""
    longest = f"{name}-workers-0-{hosts - 1}" if kind == "jobset" else f"{name}-{hosts - 1}"
    if not DNS_LABEL.fullmatch(name) or len(longest) > 63:
        raise ConfigError("--name", f"is {name!r}; use lower-case letters, digits and '-', starting with a letter, "
                          f"short enough that the pod name '{longest}' has at most 63 characters")
    if not image or any(c.isspace() for c in image):
        raise ConfigError("--image", f"is {image!r}; give the container image with jaxpar installed, "
                          "e.g. registry.example.com/jaxpar:0.1.0")
    if not DNS_SUBDOMAIN.fullmatch(claim) or len(claim) > 253:
        raise ConfigError("--claim", f"is {claim!r}; use lower-case letters, digits, '-' and '.'")
    if not QUANTITY.fullmatch(claim_size):
        raise ConfigError("--claim-size", f"is {claim_size!r}; give a storage quantity, e.g. 100Gi or 2Ti")
    if namespace is not None and (not DNS_LABEL.fullmatch(namespace) or len(namespace) > 63):
        raise ConfigError("--namespace", f"is {namespace!r}; use lower-case letters, digits and '-'")


def checkpoint_claim(meta: dict, claim: str, size: str, storage_class: str | None) -> dict:
    """The PersistentVolumeClaim every pod mounts: ReadWriteMany, since all pods write one checkpoint."""
    spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": size}}}
    if storage_class is not None:   # '' is kept: no class (a pre-provisioned volume), not the default class
        spec["storageClassName"] = storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {**meta, "name": claim}, "spec": spec}


def render(*, image: str, name: str = "jaxpar", hosts: int = 2, gpus_per_host: int = 8, kind: str = "jobset",
           train_args: list[str] | None = None, claim: str = "jaxpar-checkpoints", claim_size: str = CLAIM_SIZE,
           storage_class: str | None = None, existing_claim: bool = False, max_restarts: int = 3,
           cpu_devices: int | None = None, namespace: str | None = None) -> list[dict]:
    """The manifests (dicts, in apply order) of one training job: the checkpoint claim (unless
    `existing_claim`), then the JobSet, or the headless Service and the Indexed Job."""
    if hosts < 1:
        raise ConfigError("--hosts", f"is {hosts}; must be at least 1")
    if gpus_per_host < 0:
        raise ConfigError("--gpus-per-host", f"is {gpus_per_host}; must be 0 (CPU) or more")
    if kind not in ("jobset", "indexed-job"):
        raise ConfigError("--kind", f"is '{kind}'; valid: jobset, indexed-job")
    if max_restarts < 0:
        raise ConfigError("--max-restarts", f"is {max_restarts}; must be 0 or more")
    _check_names(name, hosts, kind, image, claim, claim_size, namespace)
    train_args = list(train_args or [])
    run_dir = f"{CHECKPOINT_MOUNT}/{name}"
    meta = {"name": name, **({"namespace": namespace} if namespace else {}), "labels": {"app": "jaxpar"}}
    claims = [] if existing_claim else [checkpoint_claim(meta, claim, claim_size, storage_class)]
    if kind == "jobset":
        # JobSet pods are <jobset>-<replicated job>-<job index>-<pod index>, under the subdomain <jobset>.
        coordinator = f"{name}-workers-0-0.{name}"
        container = _container("train", image, hosts, gpus_per_host, coordinator, train_args, run_dir, cpu_devices)
        job_spec = {"parallelism": hosts, "completions": hosts, "completionMode": "Indexed", "backoffLimit": 0,
                    "template": {"metadata": {"labels": {"app": "jaxpar"}},
                                 "spec": _pod_spec(container, claim)}}
        jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": meta,
                  "spec": {"failurePolicy": {"maxRestarts": max_restarts},
                           "network": {"enableDNSHostnames": True, "subdomain": name},
                           "replicatedJobs": [{"name": "workers", "replicas": 1, "template": {"spec": job_spec}}]}}
        return [*claims, jobset]
    # Indexed Job pods are <job>-<index>; the headless Service <job> gives them DNS names.
    coordinator = f"{name}-0.{name}"
    container = _container("train", image, hosts, gpus_per_host, coordinator, train_args, run_dir, cpu_devices)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta,
               "spec": {"clusterIP": "None", "selector": {"job-name": name},
                        "ports": [{"name": "coordinator", "port": COORDINATOR_PORT}]}}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
           "spec": {"parallelism": hosts, "completions": hosts, "completionMode": "Indexed",
                    "backoffLimit": max_restarts * hosts, "podFailurePolicy": {"rules": [
                        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [2]}}]},
                    "template": {"metadata": {"labels": {"app": "jaxpar"}},
                                 "spec": _pod_spec(container, claim, service=name)}}}
    return [*claims, service, job]


def to_yaml(manifests: list[dict], header: str = "") -> str:
    return header + yaml.safe_dump_all(manifests, sort_keys=False)


def header(image: str, kind: str, claim: str, existing_claim: bool) -> str:
    """Comment lines saying what the manifests need from the cluster, and how to apply them."""
    lines = [f"needs: nodes that can pull the image {image} (jaxpar installed)"]
    if kind == "jobset":
        lines.append("needs: the JobSet controller (jobset.x-k8s.io/v1alpha2); without it use --kind indexed-job")
    lines.append(f"needs: the PersistentVolumeClaim '{claim}' (ReadWriteMany), which must already exist"
                 if existing_claim else f"creates: the PersistentVolumeClaim '{claim}' (ReadWriteMany: its "
                 "storage class must support that, e.g. an NFS-backed one; choose it with --storage-class)")
    lines.append("apply: kubectl apply -f FILE")
    return "".join(f"# {line}\n" for line in lines)


def add_arguments(p) -> None:
    p.add_argument("--image", required=True, help="container image with jaxpar installed (required), "
                                                  "e.g. registry.example.com/jaxpar:0.1.0")
    p.add_argument("--name", default="jaxpar", help="JobSet / Job name (also the DNS subdomain)")
    p.add_argument("--hosts", type=int, default=2, help="pods, one JAX process each (default: 2)")
    p.add_argument("--gpus-per-host", type=int, default=8, help="nvidia.com/gpu per pod (default: 8; 0: CPU)")
    p.add_argument("--kind", choices=("jobset", "indexed-job"), default="jobset")
    p.add_argument("--claim", default="jaxpar-checkpoints", help="PersistentVolumeClaim for checkpoints, "
                                                                 "emitted with the job (default: jaxpar-checkpoints)")
    p.add_argument("--claim-size", help=f"storage the claim requests (default: {CLAIM_SIZE})")
    p.add_argument("--storage-class", help="storageClassName of the claim (default: the cluster's default class)")
    p.add_argument("--existing-claim", action="store_true", help="mount --claim as it exists; do not emit it")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts of the whole job after a failure")
    p.add_argument("--cpu-devices", type=int, help="CPU pods with N virtual devices each")
    p.add_argument("--namespace")
    p.add_argument("--out", help="write the manifests to this file instead of printing them")
    p.add_argument("train_args", nargs="*", help="arguments for `jaxpar train` after `--`")


def run_from_args(args) -> int:
    from jaxpar.cluster.train_args import check_train_args
    if args.existing_claim and (args.claim_size is not None or args.storage_class is not None):
        given = "--claim-size" if args.claim_size is not None else "--storage-class"
        raise ConfigError("--existing-claim", f"mounts a claim that exists, but {given} describes a new one; "
                          f"drop {given} or --existing-claim")
    check_train_args([a for a in args.train_args if a != "--"])
    manifests = render(name=args.name, hosts=args.hosts, gpus_per_host=args.gpus_per_host, image=args.image,
                       kind=args.kind, train_args=[a for a in args.train_args if a != "--"], claim=args.claim,
                       claim_size=CLAIM_SIZE if args.claim_size is None else args.claim_size,
                       storage_class=args.storage_class,
                       existing_claim=args.existing_claim, max_restarts=args.max_restarts,
                       cpu_devices=args.cpu_devices, namespace=args.namespace)
    text = to_yaml(manifests, header(args.image, args.kind, args.claim, args.existing_claim))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}; apply it with: kubectl apply -f {args.out}")
    else:
        print(text, end="")
    return 0
