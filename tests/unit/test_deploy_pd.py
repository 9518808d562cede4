"""deploy/kubernetes/pd: the prefill/decode overlays rendered (test_deploy_manifests' small Kustomize), each
object validated against the Kubernetes schemas, then checked against the code: each role's flags parse
and name its role, the router's --prefill URL is the prefill Service, its --decode URLs are exactly the
decode StatefulSet's pods through its headless Service, and the decode pods expose the KV port their flags
bind."""

from __future__ import annotations

from types import SimpleNamespace
from urllib.parse import urlsplit

import kubernetes_validate
import pytest

from llmserve.config import engine_config_from_args
from llmserve.router.pd_server import pd_config_from_args
from llmserve.server.cli import server_config_from_args

from test_deploy_manifests import KUBE, KUBE_VERSIONS, container, parse_cli, pod_spec, render, server_get_paths

PD_OVERLAYS = ("pd-cpu", "pd-cuda")


@pytest.fixture(scope="module", params=PD_OVERLAYS)
def overlay(request) -> SimpleNamespace:
    objects = render(KUBE / "overlays" / request.param)
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    assert len(by_name) == len(objects), "two objects with the same kind and name"
    return SimpleNamespace(name=request.param, objects=objects, get=lambda kind, name: by_name[(kind, name)])


def _role_args(overlay, kind: str, name: str) -> list[str]:
    return container(overlay.get(kind, name), "engine")["args"]


def _engine(overlay, kind: str, name: str):
    return engine_config_from_args(parse_cli(["serve", *_role_args(overlay, kind, name)]))


def _router_config(overlay):
    router = container(overlay.get("Deployment", "llmserve-pd-router"), "router")
    assert router["command"] == ["llmserve", "route"]
    return pd_config_from_args(parse_cli(["route", *router["args"]]))


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_object_is_valid(overlay, version):
    for obj in overlay.objects:
        kubernetes_validate.validate(obj, version, strict=True)  # raises ValidationError
    assert {o["kind"] for o in overlay.objects} == {"Namespace", "Deployment", "StatefulSet", "Service"}


def test_each_role_runs_its_mode_on_the_overlays_device(overlay):
    device = overlay.name.removeprefix("pd-")
    for kind, name, mode in (("Deployment", "llmserve-prefill", "prefill"), ("StatefulSet", "llmserve-decode", "decode")):
        config = _engine(overlay, kind, name)
        config.validate()
        assert config.kv_transfer.disaggregation_mode == mode
        assert config.model.device == device
        server = server_config_from_args(parse_cli(["serve", *_role_args(overlay, kind, name)]))
        assert (server.host, server.port) == ("0.0.0.0", 8000)
        engine = container(overlay.get(kind, name), "engine")
        assert {p["httpGet"]["path"] for p in (engine["startupProbe"], engine["readinessProbe"],
                                               engine["livenessProbe"])} == {"/health"} <= server_get_paths()
        limits = engine["resources"]["limits"]
        assert ("nvidia.com/gpu" in limits) == (device == "cuda")


def test_the_decode_pods_expose_the_kv_port_they_bind(overlay):
    decode = overlay.get("StatefulSet", "llmserve-decode")
    kv_port = _engine(overlay, "StatefulSet", "llmserve-decode").kv_transfer.disaggregation_kv_port
    ports = {p["name"]: p["containerPort"] for p in container(decode, "engine")["ports"]}
    assert ports == {"http": 8000, "kv": kv_port}
    service = overlay.get("Service", "llmserve-decode")
    assert service["spec"]["clusterIP"] == "None", "decode pods are addressed one by one: a headless Service"
    assert {(p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {(8000, "http"), (kv_port, "kv")}


def test_the_router_names_the_prefill_service_and_every_decode_pod(overlay):
    config = _router_config(overlay)
    namespace = overlay.get("Service", "llmserve-prefill")["metadata"]["namespace"]
    [prefill] = config.prefill_urls
    assert (urlsplit(prefill).hostname, urlsplit(prefill).port) == ("llmserve-prefill", 8000)
    decode = overlay.get("StatefulSet", "llmserve-decode")
    service = decode["spec"]["serviceName"]
    assert service == "llmserve-decode" and decode["metadata"]["namespace"] == namespace
    pods = [f"{decode['metadata']['name']}-{i}.{service}" for i in range(decode["spec"]["replicas"])]
    assert [(urlsplit(u).hostname, urlsplit(u).port) for u in config.decode_urls] == [(pod, 8000) for pod in pods]


def test_services_select_one_workload_with_the_named_ports(overlay):
    workloads = [o for o in overlay.objects if o["kind"] in ("Deployment", "StatefulSet")]
    for w in workloads:
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
    for service in (o for o in overlay.objects if o["kind"] == "Service"):
        selected = [w for w in workloads
                    if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, f"{service['metadata']['name']} selects {len(selected)} workloads"
        port_names = {p["name"] for c in pod_spec(selected[0])["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names


def test_images_come_from_the_overlay(overlay):
    images = {c["image"] for o in overlay.objects for c in pod_spec(o).get("containers", [])}
    assert images == {f"llmserve:{overlay.name.removeprefix('pd-')}"}

