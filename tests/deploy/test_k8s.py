"""The Kubernetes manifests render with kustomize and validate offline."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from router.policy import Policy
from specd import telemetry as names
from specd.config import DrafterConfig, RouterConfig, VerifierConfig

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


def by_kind(objects: list[dict]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for o in objects:
        out.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    return out


def workloads(objects: list[dict]) -> list[dict]:
    kinds = by_kind(objects)
    return [*kinds["Deployment"].values(), *kinds["StatefulSet"].values()]


def test_topology(rendered):
    overlay, objects = rendered
    kinds = by_kind(objects)
    assert kinds["Service"]["specd-verifier"]["spec"]["clusterIP"] == "None"  # headless
    assert set(kinds["PodDisruptionBudget"]) == {"specd-verifier", "specd-router", "specd-drafter"}
    router = kinds["Deployment"]["specd-router"]["spec"]["template"]["spec"]
    args = router["containers"][0]["args"]
    assert args[args.index("--verifier-dns") + 1] == "specd-verifier:50062"
    for workload in workloads(objects):
        container = workload["spec"]["template"]["spec"]["containers"][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" in container[probe], (workload["metadata"]["name"], probe)
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        wants_gpu = overlay == "gpu" and workload["metadata"]["name"] != "specd-router"
        assert (gpus == 1) == wants_gpu, workload["metadata"]["name"]
        assert container["image"] == ("specd:0.4.0-cuda" if overlay == "gpu" else "specd:0.4.0")
        assert container["imagePullPolicy"] == "IfNotPresent"  # a local image works
    drafter = kinds["Deployment"]["specd-drafter"]["spec"]["template"]["spec"]["containers"][0]
    base = by_kind(render("cpu"))["Deployment"]["specd-drafter"]["spec"]["template"]["spec"]
    # on a GPU of its own the drafter drafts ahead, its other flags as everywhere
    ahead = ["--draft-ahead"] if overlay == "gpu" else []
    assert drafter["args"] == base["containers"][0]["args"] + ahead


def test_the_gpu_compose_drafter_drafts_ahead_with_the_same_flags():
    base = yaml.safe_load((K8S.parent / "docker-compose.yml").read_text())
    gpu = yaml.safe_load((K8S.parent / "docker-compose.gpu.yml").read_text())
    drafter = base["services"]["drafter"]["command"]
    assert gpu["services"]["drafter"]["command"] == [*drafter, "--draft-ahead"]


def test_no_pod_downloads_models(rendered):
    # the models are baked into the image (deploy/Dockerfile): no init container fetches
    # them, no per-pod volume holds them, nothing tells the entrypoint to fetch
    _, objects = rendered
    for workload in workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        assert not pod.get("initContainers"), workload["metadata"]["name"]
        assert not any("emptyDir" in v for v in pod.get("volumes", []))
        for c in pod["containers"]:
            assert all(e["name"] != "SPECD_FETCH" or e["value"] == "none" for e in c.get("env", []))
    dockerfile = (K8S.parent / "Dockerfile").read_text()
    assert "specd models fetch" in dockerfile and "--weights int4" in dockerfile


def test_pods_meet_the_restricted_pod_security_profile(rendered):
    """The checks of Kubernetes' Pod Security Standards, profile "restricted"."""
    _, objects = rendered
    allowed_volumes = {"configMap", "secret", "emptyDir", "projected", "downwardAPI", "csi",
                       "persistentVolumeClaim", "ephemeral"}  # fmt: skip
    for workload in workloads(objects):
        name = workload["metadata"]["name"]
        pod = workload["spec"]["template"]["spec"]
        psc = pod.get("securityContext", {})
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod.get(host), (name, host)
        for volume in pod.get("volumes", []):
            assert set(volume) - {"name"} <= allowed_volumes, (name, volume)
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            sc = c.get("securityContext", {})
            assert not sc.get("privileged"), name
            assert sc.get("allowPrivilegeEscalation") is False, name
            assert "ALL" in sc.get("capabilities", {}).get("drop", []), name
            assert set(sc.get("capabilities", {}).get("add", [])) <= {"NET_BIND_SERVICE"}
            assert sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, name
            assert sc.get("runAsUser", psc.get("runAsUser", 1)) != 0, name
            seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {}))
            assert seccomp.get("type") in ("RuntimeDefault", "Localhost"), name
            assert not any("hostPort" in port for port in c.get("ports", [])), name


def test_shutdown_drains_inside_the_grace_period(rendered):
    _, objects = rendered
    for workload in workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        role = args[1]
        config = {"router": RouterConfig, "verifier": VerifierConfig, "drafter": DrafterConfig}
        drain = (
            float(args[args.index("--drain-seconds") + 1])
            if "--drain-seconds" in args
            else (config[role].drain_seconds)
        )
        assert drain + 10 <= pod["terminationGracePeriodSeconds"], workload["metadata"]["name"]


def test_only_the_router_is_open_and_it_asks_for_a_token(rendered):
    _, objects = rendered
    kinds = by_kind(objects)
    policies = kinds["NetworkPolicy"]
    assert set(policies) == {"specd-router", "specd-verifier", "specd-drafter"}

    def grpc_sources(name: str, port: int) -> list:
        rules = policies[name]["spec"]["ingress"]
        return [r.get("from") for r in rules if {"protocol": "TCP", "port": port} in r["ports"]]

    router_only = [[{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "specd-router"}}}]]
    verifiers = [[{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "specd-verifier"}}}]]
    assert grpc_sources("specd-verifier", 50062) == router_only
    assert grpc_sources("specd-drafter", 50061) == verifiers
    assert grpc_sources("specd-router", 50051) == [None]  # clients, from anywhere
    router = kinds["Deployment"]["specd-router"]["spec"]["template"]["spec"]
    args = router["containers"][0]["args"]
    # the OpenAI-compatible door: served, exposed by the Service, open like gRPC
    http = int(args[args.index("--http-port") + 1])
    assert grpc_sources("specd-router", http) == [None]
    container_ports = {p["name"]: p["containerPort"] for p in router["containers"][0]["ports"]}
    service = kinds["Service"]["specd-router"]["spec"]["ports"]
    assert {"name": "http", "port": http, "targetPort": "http"} in service
    assert container_ports["http"] == http
    token = args[args.index("--auth-token-file") + 1]
    mounts = {m["mountPath"]: m["name"] for m in router["containers"][0]["volumeMounts"]}
    volume = next(v for v in router["volumes"] if v["name"] == mounts[str(Path(token).parent)])
    assert volume["secret"]["secretName"] == "specd-auth"


def test_the_verifiers_autoscale_on_their_queue_and_are_scraped(rendered):
    _, objects = rendered
    kinds = by_kind(objects)
    hpa = kinds["HorizontalPodAutoscaler"]["specd-verifier"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                     "name": "specd-verifier"}  # fmt: skip
    metric = hpa["metrics"][0]["pods"]["metric"]["name"]
    adapter = yaml.safe_load((K8S.parent / "observability" / "prometheus-adapter.yaml").read_text())
    rule = adapter["rules"]["custom"][0]
    assert rule["name"]["as"] == metric
    assert rule["seriesQuery"].startswith(names.WAITING + "{")  # what the verifier exports
    for workload in workloads(objects):
        notes = workload["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/port"] == "9400"


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


def test_the_service_monitor_scrapes_every_service_with_a_metrics_port(tmp_path):
    overlay = tmp_path / "with-monitor"
    overlay.mkdir()
    cpu, components = (os.path.relpath(K8S / p, overlay) for p in ("overlays/cpu", "components"))
    (overlay / "kustomization.yaml").write_text(  # kustomize takes no absolute paths
        f"resources: [{cpu}]\ncomponents: [{components}/service-monitor]\n"
    )
    out = subprocess.run(
        [
            shutil.which("kubectl"),
            "kustomize",
            str(overlay),
            "--load-restrictor=LoadRestrictionsNone",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    kinds = by_kind([d for d in yaml.safe_load_all(out) if d])
    monitor = kinds["ServiceMonitor"]["specd"]["spec"]
    assert monitor["endpoints"][0]["port"] == "metrics"
    with_metrics = [
        s
        for s in kinds["Service"].values()
        if any(p["name"] == "metrics" for p in s["spec"]["ports"])
    ]
    assert {s["metadata"]["name"] for s in with_metrics} >= {"specd-verifier", "specd-drafter"}
    for service in with_metrics:
        assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()


def test_every_image_tag_is_the_packages_version():
    import tomllib

    import specd

    version = tomllib.loads((K8S.parents[1] / "pyproject.toml").read_text())["project"]["version"]
    assert specd.__version__ == version
    tags = [
        image["newTag"]
        for overlay in ("cpu", "gpu")
        for image in yaml.safe_load(
            (K8S / "overlays" / overlay / "kustomization.yaml").read_text()
        )["images"]
    ]
    compose = (K8S.parent / "docker-compose.yml").read_text() + (
        K8S.parent / "docker-compose.gpu.yml"
    ).read_text()
    assert tags == [version, f"{version}-cuda"]
    assert f"specd:{version}}}" in compose and f"specd:{version}-cuda}}" in compose
