"""`jaxpar k8s` manifests validate against the Kubernetes API types, and a pod's env starts jax.distributed right.

The types are the official `kubernetes` Python client's models (generated from the
API's OpenAPI schema; offline). JobSet is a custom resource the client does not
know: its own fields are checked against the JobSet v1alpha2 API, and the Job
template inside it against the client's V1JobTemplateSpec.
"""
import re
from pathlib import Path

import pytest
import yaml

from jaxpar.cli import main
from jaxpar.cluster.k8s import INDEX_ANNOTATION, to_yaml
from jaxpar.cluster.k8s import render as render_with_image
from jaxpar.config import ConfigError
from jaxpar.mesh import distributed_args

client = pytest.importorskip("kubernetes.client", reason="the kubernetes client is the `ops` extra")

IMAGE = "registry.example.com/jaxpar:0.1.0"   # the image of the shipped manifests (scripts/k8s/)


def render(**kwargs):
    return render_with_image(**{"image": IMAGE, **kwargs})

PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object,
              "datetime": str, "date": str}
# JobSet v1alpha2 fields jaxpar uses (sigs.k8s.io/jobset api/jobset/v1alpha2/jobset_types.go).
JOBSET_FIELDS = {"spec": {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy",
                          "suspend", "coordinator", "managedBy", "ttlSecondsAfterFinished"},
                 "network": {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"},
                 "failurePolicy": {"maxRestarts", "restartStrategy", "rules"},
                 "replicatedJob": {"name", "template", "replicas", "dependsOn"}}


def validate(value, type_name: str, path: str = "$") -> None:
    """Raise AssertionError where `value` does not fit the client model `type_name` (unknown field, wrong type)."""
    if type_name.startswith(("list[", "List[")):
        assert isinstance(value, list), f"{path}: expected a list"
        for i, item in enumerate(value):
            validate(item, type_name[5:-1], f"{path}[{i}]")
        return
    if type_name.startswith(("dict(", "Dict[")):
        assert isinstance(value, dict), f"{path}: expected a map"
        inner = type_name[5:-1].split(", ", 1)[1]
        for key, item in value.items():
            validate(item, inner, f"{path}.{key}")
        return
    if type_name in PRIMITIVES:
        assert isinstance(value, PRIMITIVES[type_name]), f"{path}: expected {type_name}, got {value!r}"
        return
    model = getattr(client, type_name)
    assert isinstance(value, dict), f"{path}: expected a {type_name} object"
    by_json_name = {json_name: attr for attr, json_name in model.attribute_map.items()}
    for key, item in value.items():
        assert key in by_json_name, f"{path}.{key}: not a field of {type_name}"
        validate(item, model.openapi_types[by_json_name[key]], f"{path}.{key}")


def test_the_validator_catches_mistakes():
    with pytest.raises(AssertionError, match="not a field of V1Container"):
        validate({"name": "x", "imagePullPolcy": "Always"}, "V1Container")
    with pytest.raises(AssertionError, match="expected int"):
        validate({"parallelism": "2"}, "V1JobSpec")


@pytest.mark.parametrize("hosts, gpus", [(2, 8), (16, 8)])
def test_indexed_job_and_headless_service_validate(hosts, gpus):
    claim, service, job = render(kind="indexed-job", hosts=hosts, gpus_per_host=gpus, train_args=["--config", "c.py"])
    validate(claim, "V1PersistentVolumeClaim")
    validate(service, "V1Service")
    validate(job, "V1Job")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"job-name": "jaxpar"}
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"] == hosts
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] and pod["restartPolicy"] == "Never"
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"] == "jaxpar-checkpoints"


def test_jobset_validates():
    claim, jobset = render(kind="jobset", hosts=4, max_restarts=5)
    validate(claim, "V1PersistentVolumeClaim")
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    validate(jobset["metadata"], "V1ObjectMeta")
    spec = jobset["spec"]
    assert set(spec) <= JOBSET_FIELDS["spec"]
    assert set(spec["network"]) <= JOBSET_FIELDS["network"]
    assert set(spec["failurePolicy"]) <= JOBSET_FIELDS["failurePolicy"]
    assert spec["failurePolicy"]["maxRestarts"] == 5
    for replicated in spec["replicatedJobs"]:
        assert set(replicated) <= JOBSET_FIELDS["replicatedJob"]
        validate(replicated["template"], "V1JobTemplateSpec")
        assert replicated["template"]["spec"]["parallelism"] == 4


def pod_environment(container, index: int) -> dict[str, str]:
    """The environment Kubernetes gives the container of pod `index` (fieldRefs resolved as the kubelet does)."""
    env = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path == f"metadata.annotations['{INDEX_ANNOTATION}']"
            env[var["name"]] = str(index)
    return env


@pytest.mark.parametrize("kind, pod0", [("jobset", "jaxpar-workers-0-0.jaxpar"), ("indexed-job", "jaxpar-0.jaxpar")])
def test_pod_env_becomes_the_distributed_initialize_arguments(kind, pod0):
    manifests = render(kind=kind, hosts=3)
    job = manifests[-1]
    template = job["spec"]["replicatedJobs"][0]["template"] if kind == "jobset" else job
    container = template["spec"]["template"]["spec"]["containers"][0]
    for index in range(3):
        assert distributed_args(pod_environment(container, index)) == {
            "coordinator_address": f"{pod0}:8476", "num_processes": 3, "process_id": index}
    command = container["command"][2]
    assert "--auto-resume" in command and re.search(r"--run-dir /checkpoints/jaxpar\b", command)


def test_cli_prints_yaml_and_refuses_bad_input(capsys):
    assert main(["k8s", "--image", IMAGE, "--hosts", "2", "--kind", "indexed-job", "--", "--config",
                 "configs/llama_1b.py"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["PersistentVolumeClaim", "Service", "Job"]
    assert docs == render(kind="indexed-job", hosts=2, train_args=["--config", "configs/llama_1b.py"])
    with pytest.raises(ConfigError, match="--hosts"):
        render(hosts=0)
    assert list(yaml.safe_load_all(to_yaml(render()))) == render()


@pytest.mark.parametrize("kind, file", [("jobset", "jobset.yaml"), ("indexed-job", "indexed-job.yaml")])
def test_the_shipped_manifests_are_the_rendered_ones(kind, file):
    shipped = list(yaml.safe_load_all((Path(__file__).resolve().parent.parent / "scripts" / "k8s" / file).read_text()))
    assert shipped[0]["kind"] == "PersistentVolumeClaim"
    assert shipped == render(kind=kind, hosts=2, train_args=["--config", "configs/llama_1b.py"])


def test_the_image_is_required_and_the_output_says_what_must_exist(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["k8s", "--hosts", "2"])
    assert exit_.value.code == 2 and "--image" in capsys.readouterr().err
    assert main(["k8s", "--image", IMAGE, "--claim", "ckpt", "--claim-size", "2Ti", "--storage-class", "nfs"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("# ")]
    assert any(IMAGE in line for line in notes) and any("JobSet controller" in line for line in notes)
    assert any("creates: the PersistentVolumeClaim 'ckpt'" in line for line in notes)
    claim, jobset = yaml.safe_load_all(out)
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "2Ti"}},
                             "storageClassName": "nfs"}
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "ckpt"
    assert pod["containers"][0]["image"] == IMAGE
    # An existing claim is mounted, not emitted, and the output says it must exist.
    assert main(["k8s", "--image", IMAGE, "--kind", "indexed-job", "--existing-claim", "--out",
                 str(tmp_path / "job.yaml")]) == 0
    text = (tmp_path / "job.yaml").read_text()
    assert [d["kind"] for d in yaml.safe_load_all(text)] == ["Service", "Job"]
    assert "# needs: the PersistentVolumeClaim 'jaxpar-checkpoints' (ReadWriteMany), which must already exist" in text


def test_an_empty_storage_class_is_kept_as_no_class():
    """`--storage-class ''` binds a pre-provisioned volume (no dynamic provisioning); it used to be dropped, which
    asks for the cluster's default class instead."""
    claim = render(hosts=2, storage_class="")[0]
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["storageClassName"] == ""
    assert "storageClassName" not in render(hosts=2)[0]["spec"]


@pytest.mark.parametrize("field, value", [("name", "Bad_Name!"), ("name", "x" * 60), ("image", "two words"),
                                          ("claim", "Bad_Claim"), ("claim_size", "lots"), ("namespace", "A b")])
def test_names_kubernetes_would_refuse_are_refused(field, value):
    with pytest.raises(ConfigError, match=f"--{field.replace('_', '-')}"):
        render(**{field: value})
