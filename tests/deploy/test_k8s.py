"""The Kubernetes manifests render with kustomize and validate offline."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from router.policy import Policy

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
K8S_VERSION = "1.30.0"


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is missing: `make deploy-tools` installs it")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def rendered(request):
    return request.param, render(request.param)


def test_every_object_validates(rendered):
    import kubernetes_validate

    _, objects = rendered
    assert objects
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_topology(rendered):
    overlay, objects = rendered
    by_kind = {}
    for o in objects:
        by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    assert by_kind["Service"]["specd-verifier"]["spec"]["clusterIP"] == "None"  # headless
    assert set(by_kind["PodDisruptionBudget"]) == {
        "specd-verifier",
        "specd-router",
        "specd-drafter",
    }
    assert "specd-router" in by_kind["HorizontalPodAutoscaler"]
    router = by_kind["Deployment"]["specd-router"]["spec"]["template"]["spec"]
    args = router["containers"][0]["args"]
    assert args[args.index("--verifier-dns") + 1] == "specd-verifier:50062"
    for workload in [*by_kind["Deployment"].values(), *by_kind["StatefulSet"].values()]:
        container = workload["spec"]["template"]["spec"]["containers"][0]
        assert "grpc" in container["readinessProbe"] and "grpc" in container["livenessProbe"]
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        wants_gpu = overlay == "gpu" and workload["metadata"]["name"] != "specd-router"
        assert (gpus == 1) == wants_gpu, workload["metadata"]["name"]
        assert container["image"] == ("specd:cuda" if overlay == "gpu" else "specd:latest")


def test_policy_configmap_parses_with_the_router_loader(rendered):
    _, objects = rendered
    cm = next(
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "specd-policy"
    )
    policy = Policy.from_yaml(cm["data"]["policy.yaml"])
    assert policy.routes["batch"].speculation == "off"
    assert policy.routes["code"].num_draft_tokens == 6
    mounted = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "specd-router"
    )
    volumes = mounted["spec"]["template"]["spec"]["volumes"]
    assert {"name": "policy", "configMap": {"name": "specd-policy"}} in volumes
