"""The inference gateway layout (deploy/k8s/overlays/gateway): it renders and validates
offline, the pool selects pods that answer OpenAI HTTP on its target port, and a pod's
two processes, run here from the manifest's own arguments, serve a completion and export
the endpoint picker's gauges under vLLM's names where the picker scrapes them."""

from __future__ import annotations

import json
import urllib.request

import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from launcher.processes import ServerProcess, free_port
from tests.cluster import save_tiny_cluster_model
from tests.deploy.test_k8s import K8S, K8S_VERSION, by_kind, render


def resource(api_version: str, spec: dict) -> dict:
    """A custom resource of `api_version` whose spec follows `spec`."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {"const": api_version}, "spec": spec},
    }


# The fields of the Gateway API Inference Extension's InferencePool v1 and of Gateway
# API's HTTPRoute v1 that this layout sets, with the constraints their CRDs publish
# (required fields, one target port in 1-65535, the failure modes), written out here so
# the check runs offline; any field not listed is refused, so a misspelt one shows
POOL_SCHEMA = resource(
    "inference.networking.k8s.io/v1",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["selector", "targetPorts", "endpointPickerRef"],
        "properties": {
            "selector": {
                "type": "object",
                "additionalProperties": False,
                "required": ["matchLabels"],
                "properties": {"matchLabels": {"type": "object", "minProperties": 1}},
            },
            "targetPorts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["number"],
                    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
                },
            },
            "endpointPickerRef": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "port"],
                "properties": {
                    "group": {"type": "string"},
                    "kind": {"type": "string"},
                    "name": {"type": "string", "minLength": 1},
                    "port": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["number"],
                        "properties": {
                            "number": {"type": "integer", "minimum": 1, "maximum": 65535}
                        },
                    },
                    "failureMode": {"enum": ["FailOpen", "FailClose"]},
                },
            },
        },
    },
)
ROUTE_SCHEMA = resource(
    "gateway.networking.k8s.io/v1",
    {
        "type": "object",
        "required": ["parentRefs", "rules"],
        "properties": {
            "parentRefs": {
                "type": "array",
                "minItems": 1,
                "items": {"type": "object", "required": ["name"]},
            },
            "rules": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "backendRefs": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["name"],
                                "properties": {
                                    "group": {"type": "string"},
                                    "kind": {"type": "string"},
                                    "name": {"type": "string"},
                                    "port": {"type": "integer"},
                                    "weight": {"type": "integer"},
                                },
                            },
                        },
                        "matches": {"type": "array"},
                    },
                },
            },
        },
    },
)
CUSTOM = {"InferencePool": POOL_SCHEMA, "HTTPRoute": ROUTE_SCHEMA}


@pytest.fixture(scope="module")
def objects():
    return render("gateway")


def test_every_object_validates(objects):
    import kubernetes_validate

    kinds = {o["kind"] for o in objects}
    assert {"InferencePool", "HTTPRoute", "StatefulSet", "Deployment"} <= kinds
    for obj in objects:
        if obj["kind"] in CUSTOM:
            jsonschema.validate(obj, CUSTOM[obj["kind"]])
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    with pytest.raises(jsonschema.ValidationError):  # the schema refuses a wrong field
        pool = by_kind(objects)["InferencePool"]["specd"]
        jsonschema.validate({**pool, "spec": {**pool["spec"], "targetPort": 8000}}, POOL_SCHEMA)


def pod_spec(objects) -> dict:
    return by_kind(objects)["StatefulSet"]["specd-verifier"]["spec"]["template"]


def container(objects, name: str) -> dict:
    return next(c for c in pod_spec(objects)["spec"]["containers"] if c["name"] == name)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_pool_routes_to_pods_that_answer_http_and_the_picker_reads_their_gauges(objects):
    kinds = by_kind(objects)
    pool = kinds["InferencePool"]["specd"]["spec"]
    template = pod_spec(objects)
    assert pool["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert template["metadata"]["labels"]["llm-d.ai/engine-type"] == "vllm"
    router, verifier = container(objects, "router")["args"], container(objects, "verifier")["args"]
    assert int(flag(router, "--http-port")) == pool["targetPorts"][0]["number"]
    assert flag(router, "--verifier") == f"127.0.0.1:{flag(verifier, '--port')}"
    picker = kinds["Deployment"]["specd-endpoint-picker"]["spec"]["template"]["spec"]
    epp = picker["containers"][0]["args"]
    assert flag(epp, "--pool-name") == "specd"
    assert flag(epp, "--model-server-metrics-port") == flag(verifier, "--metrics-port")
    assert flag(router, "--metrics-port") != flag(verifier, "--metrics-port")  # one netns
    ref = pool["endpointPickerRef"]
    service = kinds["Service"][ref["name"]]["spec"]
    assert service["ports"][0]["port"] == ref["port"]["number"] == int(flag(epp, "--grpc-port"))
    config = yaml.safe_load(kinds["ConfigMap"]["specd-endpoint-picker"]["data"]["config.yaml"])
    declared = {p["type"] for p in config["plugins"]}
    used = {p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]}
    assert used <= declared and "max-score-picker" in used
    route = kinds["HTTPRoute"]["specd"]["spec"]["rules"][0]["backendRefs"][0]
    assert (route["kind"], route["name"]) == ("InferencePool", "specd")
    assert "Deployment" not in kinds or "specd-router" not in kinds["Deployment"]
    policy = kinds["NetworkPolicy"]["specd-verifier"]["spec"]["ingress"]
    assert {"protocol": "TCP", "port": pool["targetPorts"][0]["number"]} in policy[0]["ports"]


def local(args: list[str], ports: dict[str, str], model, tmp_path) -> list[str]:
    """A container's arguments for a process here: its ports remapped (`ports`), the tiny
    model, the repository's policy file, no drafter."""
    out = []
    for arg in args[2:]:  # past "serve ROLE"
        for old, new in ports.items():
            arg = arg.replace(old, new)
        out.append(arg.replace("/etc/specd/policy.yaml", str(K8S / "base" / "policy.yaml")))
    for name in ("--model", "--tokenizer"):
        if name in out:
            out[out.index(name) + 1] = str(model)
    if "--drafter" in out:
        i = out.index("--drafter")
        del out[i : i + 2]
    for name in ("--host", "--port"):  # ServerProcess sets its own
        if name in out:
            i = out.index(name)
            del out[i : i + 2]
    return out


def test_a_pods_processes_serve_http_and_export_the_pickers_gauges(objects, tmp_path):
    model = save_tiny_cluster_model(tmp_path / "tiny")
    router_args, verifier_args = (container(objects, n)["args"] for n in ("router", "verifier"))
    grpc_port = flag(verifier_args, "--port")
    ports = {p: str(free_port()) for p in {grpc_port, "9400", "9401", "8000"}}
    verifier = ServerProcess(
        "verifier",
        *local(verifier_args, ports, model, tmp_path),
        "--dtype",
        "float32",
        logs=tmp_path,
        port=int(ports[grpc_port]),
    ).start()
    router = ServerProcess("router", *local(router_args, ports, model, tmp_path), logs=tmp_path)
    router.start()
    try:
        http = f"http://127.0.0.1:{ports['8000']}/v1"
        models = json.loads(urllib.request.urlopen(f"{http}/models", timeout=10).read())
        body = {
            "model": models["data"][0]["id"],
            "prompt": "abc",
            "max_tokens": 4,
            "ignore_eos": True,
        }
        request = urllib.request.Request(
            f"{http}/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        answer = json.loads(urllib.request.urlopen(request, timeout=30).read())
        assert answer["usage"]["completion_tokens"] == 4
        metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{ports['9400']}/metrics", timeout=5
        ).read()
        families = {f.name: f for f in text_string_to_metric_families(metrics.decode())}
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
            assert families[name].type == "gauge" and families[name].samples[0].value == 0
        usage = families["vllm:kv_cache_usage_perc"].samples[0]
        assert usage.value == 0 and usage.labels["model_name"]
        # the router's own metrics on its HTTP port, as vLLM serves /metrics beside /v1
        served = urllib.request.urlopen(f"http://127.0.0.1:{ports['8000']}/metrics", timeout=5)
        router_families = {
            f.name: f for f in text_string_to_metric_families(served.read().decode())
        }
        requests = router_families["specd:requests"]
        assert sum(s.value for s in requests.samples if s.name.endswith("_total")) == 1
        # and as vLLM's dashboards read a pod's requests, under the model's served name
        (success,) = router_families["vllm:request_success"].samples
        assert success.value == 1 and success.labels == {
            "model_name": body["model"],
            "finished_reason": "length",
        }
    finally:
        for p in (router, verifier):
            p.stop()
