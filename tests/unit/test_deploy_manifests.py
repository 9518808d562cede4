"""deploy/: the Kubernetes overlays rendered and checked against the schemas, and against the code they run.

No cluster and no kustomize binary here: `render()` applies the subset of Kustomize the overlays use
(resources, namespace, images, strategic-merge patches from files, JSON 6902 patches inline) and refuses
any other key, so an overlay cannot silently use a feature this renderer would get wrong. Every object is
validated with kubernetes-validate (the Kubernetes OpenAPI schemas, strict: unknown fields fail) at the
oldest and newest version we claim; the KEDA ScaledObject against the CRD schema vendored from KEDA's
release (deploy/kubernetes/schemas/), made strict the same way. Then the cross-references: selectors,
ports, probe paths, the autoscaler's target and metric, the container flags (parsed by the real CLI
parsers) and the shutdown budget.
"""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from llmserve.cli import build_parser
from llmserve.config import engine_config_from_args
from llmserve.engine.async_llm import AsyncLLM
from llmserve.server.cli import server_config_from_args
from llmserve.server.launcher import ABORT_GRACE_S

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
DOCKER = ROOT / "deploy" / "docker"
OVERLAYS = ("cpu", "cuda")
KUBE_VERSIONS = ("1.30", "1.37")  # oldest (preStop exec, probes as used) and newest schemas bundled
KUSTOMIZE_KEYS = {"apiVersion", "kind", "namespace", "resources", "images", "patches"}
# The prometheus trigger's metadata keys: KEDA v2.20.2, pkg/scalers/prometheus_scaler.go (the CRD leaves
# `metadata` free-form, so its schema cannot catch a misspelt key).
KEDA_PROMETHEUS_KEYS = {"serverAddress", "query", "queryParameters", "threshold", "activationThreshold",
                        "namespace", "customHeaders", "ignoreNullValues", "unsafeSsl", "awsRegion", "timeout",
                        "identityOwner"}
KEDA_PROMETHEUS_REQUIRED = {"serverAddress", "query", "threshold"}
MERGE_KEYS = {"volumeMounts": "mountPath", "ports": "containerPort"}  # else by `name`; lists of scalars replace


# ---- a small Kustomize -----------------------------------------------------------------------------------

def render(directory: Path) -> list[dict]:
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kust) - KUSTOMIZE_KEYS
    assert not unknown, f"{directory}: kustomization keys this renderer does not implement: {sorted(unknown)}"
    objects = [obj for entry in kust.get("resources", []) for obj in _load_resource(directory / entry)]
    for patch in kust.get("patches", []):
        _apply_patch(objects, directory, patch)
    for image in kust.get("images", []):
        _set_image(objects, image)
    if "namespace" in kust:
        for obj in objects:
            if obj["kind"] != "Namespace":
                obj["metadata"]["namespace"] = kust["namespace"]
    return objects


def _load_resource(path: Path) -> list[dict]:
    if path.is_dir():
        return render(path)
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _find(objects: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"patch target {kind}/{name}: {len(matches)} matches"
    return matches[0]


def _apply_patch(objects: list[dict], directory: Path, patch: dict) -> None:
    assert set(patch) in ({"path"}, {"target", "patch"}), f"unsupported patch form: {sorted(patch)}"
    if "path" in patch:
        body = yaml.safe_load((directory / patch["path"]).read_text())
        target = _find(objects, body["kind"], body["metadata"]["name"])
        target.update(strategic_merge(target, body))
        return
    target = _find(objects, patch["target"]["kind"], patch["target"]["name"])
    for op in yaml.safe_load(patch["patch"]):
        _json_patch(target, op)


def strategic_merge(base, patch, key: str = ""):
    """Maps merge key by key; lists of maps merge item by item on their merge key; other lists replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for k, v in patch.items():
            merged[k] = strategic_merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and patch and all(isinstance(p, dict) for p in patch):
        merge_key = MERGE_KEYS.get(key, "name")
        merged = [dict(item) for item in base]
        for item in patch:
            same = [i for i, b in enumerate(merged) if b.get(merge_key) == item[merge_key]]
            if same:
                merged[same[0]] = strategic_merge(merged[same[0]], item, key)
            else:
                merged.append(copy.deepcopy(item))
        return merged
    return copy.deepcopy(patch)


def _json_patch(target: dict, op: dict) -> None:
    assert op["op"] in ("add", "replace"), f"unsupported JSON patch op {op['op']}"
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
    node = target
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        if last == "-":
            node.append(op["value"])
        elif op["op"] == "add":
            node.insert(int(last), op["value"])
        else:
            node[int(last)] = op["value"]
    else:
        node[last] = op["value"]


def _set_image(objects: list[dict], image: dict) -> None:
    for container in (c for o in objects for c in pod_spec(o).get("containers", [])):
        if container["image"].split(":")[0] == image["name"]:
            container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"] if obj["kind"] in ("Deployment", "StatefulSet") else {}


# ---- fixtures and helpers --------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> SimpleNamespace:
    objects = render(KUBE / "overlays" / request.param)
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    assert len(by_name) == len(objects), "two objects with the same kind and name"
    return SimpleNamespace(name=request.param, objects=objects, get=lambda kind, name: by_name[(kind, name)])


def container(deployment: dict, name: str) -> dict:
    return next(c for c in pod_spec(deployment)["containers"] if c["name"] == name)


def parse_cli(command: list[str]):
    return build_parser().parse_args(command)


def engine_args(overlay) -> list[str]:
    return container(overlay.get("Deployment", "llmserve-engine"), "engine")["args"]


def strict(schema):
    """additionalProperties: false wherever an object lists its properties and allows nothing else, as
    kubernetes-validate's strict schemas do (the API server prunes unknown fields; we want them to fail)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def keda_validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((KUBE / "schemas" / "keda.sh_scaledobjects.yaml").read_text())
    assert crd["metadata"]["name"] == "scaledobjects.keda.sh"
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    return jsonschema.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))


# ---- schemas ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_kubernetes_object_is_valid(overlay, version):
    kinds = set()
    for obj in overlay.objects:
        kinds.add(obj["kind"])
        if obj["apiVersion"].startswith("keda.sh/"):
            continue
        kubernetes_validate.validate(obj, version, strict=True)  # raises ValidationError
    assert kinds == {"Namespace", "Deployment", "Service", "ScaledObject"}


def test_scaled_object_is_valid_against_kedas_crd(overlay, keda_validator):
    scaled = overlay.get("ScaledObject", "llmserve-engine")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in keda_validator.iter_errors(scaled)]
    assert not errors


def test_the_validators_catch_mistakes(overlay, keda_validator):
    deployment = copy.deepcopy(overlay.get("Deployment", "llmserve-engine"))
    container(deployment, "engine")["livenessProbe"]["httpGet"]["pth"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[-1], strict=True)
    typo = copy.deepcopy(overlay.get("ScaledObject", "llmserve-engine"))
    typo["spec"]["maxReplicas"] = typo["spec"].pop("maxReplicaCount")
    wrong_type = copy.deepcopy(overlay.get("ScaledObject", "llmserve-engine"))
    wrong_type["spec"]["minReplicaCount"] = "one"
    missing = copy.deepcopy(overlay.get("ScaledObject", "llmserve-engine"))
    del missing["spec"]["scaleTargetRef"]["name"]
    for bad in (typo, wrong_type, missing):
        assert not keda_validator.is_valid(bad)


# ---- cross-references ------------------------------------------------------------------------------------

def test_selectors_match_labels_and_ports_exist(overlay):
    deployments = [o for o in overlay.objects if o["kind"] == "Deployment"]
    for d in deployments:
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for service in (o for o in overlay.objects if o["kind"] == "Service"):
        selected = [d for d in deployments if service["spec"]["selector"].items()
                    <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, f"{service['metadata']['name']} selects {len(selected)} Deployments"
        port_names = {p["name"] for c in pod_spec(selected[0])["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names


def _probes(c: dict) -> dict:
    return {kind: c[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in c}


def test_engine_probes_use_the_servers_health_route(overlay):
    engine = container(overlay.get("Deployment", "llmserve-engine"), "engine")
    probes = _probes(engine)
    assert set(probes) == {"startupProbe", "readinessProbe", "livenessProbe"}
    assert {p["httpGet"]["path"] for p in probes.values()} == {"/health"} <= server_get_paths()
    assert {p["httpGet"]["port"] for p in probes.values()} == {port["name"] for port in engine["ports"]}


def test_engine_probe_timing_fits_the_server(overlay):
    server = server_config_from_args(parse_cli(["serve", *engine_args(overlay)]))
    probes = _probes(container(overlay.get("Deployment", "llmserve-engine"), "engine"))
    startup, liveness = probes["startupProbe"], probes["livenessProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= server.engine_startup_timeout
    # a stuck engine turns /health 503 after the stall timeout; liveness then restarts it within minutes
    liveness_window = liveness["periodSeconds"] * liveness["failureThreshold"]
    assert 30 <= liveness_window <= 300 and server.health_stall_timeout <= 300
    assert liveness["timeoutSeconds"] < liveness["periodSeconds"]


def test_router_probes_use_the_routers_routes(overlay):
    router = container(overlay.get("Deployment", "llmserve-router"), "router")
    probes = _probes(router)
    assert probes["readinessProbe"]["httpGet"]["path"] in router_get_paths(router)
    assert "httpGet" not in probes["livenessProbe"], "router /health is 503 with no healthy backend: no restarts"


def test_engine_args_parse_with_the_serve_cli(overlay):
    args = parse_cli(["serve", *engine_args(overlay)])
    engine_config_from_args(args).validate()
    server = server_config_from_args(args)
    port = container(overlay.get("Deployment", "llmserve-engine"), "engine")["ports"][0]["containerPort"]
    assert (server.host, server.port) == ("0.0.0.0", port)
    device = engine_config_from_args(args).model.device
    assert device == {"cpu": "cpu", "cuda": "cuda"}[overlay.name]


def test_termination_grace_outlasts_the_drain(overlay):
    deployment = overlay.get("Deployment", "llmserve-engine")
    spec, engine = pod_spec(deployment), container(deployment, "engine")
    server = server_config_from_args(parse_cli(["serve", *engine_args(overlay)]))
    pre_stop = engine["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    engine_stop_s = AsyncLLM.shutdown.__defaults__[0]
    budget = float(pre_stop[1]) + server.shutdown_timeout + ABORT_GRACE_S + engine_stop_s
    assert spec["terminationGracePeriodSeconds"] > budget


def test_scaled_object_targets_the_engine_on_a_server_metric(overlay):
    from llmserve.server.metrics import ServerMetrics

    scaled, deployment = overlay.get("ScaledObject", "llmserve-engine"), overlay.get("Deployment", "llmserve-engine")
    ref = scaled["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert scaled["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    assert KEDA_PROMETHEUS_REQUIRED <= trigger["metadata"].keys() <= KEDA_PROMETHEUS_KEYS
    assert urlsplit(trigger["metadata"]["serverAddress"]).scheme in ("http", "https")
    query = trigger["metadata"]["query"]
    exported = {m.name for m in ServerMetrics("m").registry.collect()}
    assert set(re.findall(r"llmserve:[a-z_]+", query)) == {"llmserve:num_requests_waiting"} <= exported
    assert f'namespace="{deployment["metadata"]["namespace"]}"' in query
    pod_pattern = re.search(r'pod=~"([^"]+)"', query).group(1)
    assert re.fullmatch(pod_pattern, f"{deployment['metadata']['name']}-7d9f8b6c5d-x2x4q")
    assert not re.fullmatch(pod_pattern, "llmserve-router-7d9f8b6c5d-x2x4q")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == container(deployment, "engine")["ports"][0]["containerPort"]
    assert annotations["prometheus.io/path"] in server_get_paths()


def test_router_points_at_the_engine_service(overlay):
    from llmserve.router.loading import setup_from_args

    router = container(overlay.get("Deployment", "llmserve-router"), "router")
    assert router["command"] == ["llmserve", "route"]
    setup = setup_from_args(parse_cli(["route", *router["args"]]))
    served = server_config_from_args(parse_cli(["serve", *engine_args(overlay)])).served_model_name
    service = overlay.get("Service", "llmserve-engine")
    [pool] = setup.pools
    assert pool.name == served
    for backend in pool.backends:
        url = urlsplit(backend.url)
        assert url.hostname in (service["metadata"]["name"],
                                f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc")
        assert url.port in {p["port"] for p in service["spec"]["ports"]}
    port = router["ports"][0]["containerPort"]
    assert (setup.router.host, setup.router.port) == ("0.0.0.0", port)


def test_resources_per_variant(overlay):
    engine = container(overlay.get("Deployment", "llmserve-engine"), "engine")
    requests, limits = engine["resources"]["requests"], engine["resources"]["limits"]
    assert {"cpu", "memory"} <= requests.keys() and "memory" in limits
    if overlay.name == "cuda":
        assert limits["nvidia.com/gpu"] == requests["nvidia.com/gpu"] == 1
    else:
        assert "nvidia.com/gpu" not in limits
        threads = engine_config_from_args(parse_cli(["serve", *engine_args(overlay)])).model.num_threads
        assert threads < float(limits["cpu"]), "leave a core to the HTTP front"


def test_images_come_from_the_overlay(overlay):
    images = {c["image"] for o in overlay.objects for c in pod_spec(o).get("containers", [])}
    assert images == {f"llmserve:{overlay.name}"}


def test_pods_run_as_the_images_non_root_user(overlay):
    uid = int(re.search(r"useradd .*--uid (\d+)", (DOCKER / f"Dockerfile.{overlay.name}").read_text()).group(1))
    for deployment in (o for o in overlay.objects if o["kind"] == "Deployment"):
        context = pod_spec(deployment)["securityContext"]
        assert context["runAsNonRoot"] and context["runAsUser"] == uid


# ---- the routes the probes name ------------------------------------------------------------------------

def server_get_paths() -> set[str]:
    from llmserve.server.api_server import build_app
    from llmserve.server.config import ServerConfig
    from llmserve.server.metrics import ServerMetrics

    engine = SimpleNamespace(tokenizer=SimpleNamespace(all_special_ids=[]))  # what building the routes reads
    app = build_app(SimpleNamespace(config=ServerConfig(), metrics=ServerMetrics("m"), engine=engine))
    return {r.path for r in app.routes if "GET" in getattr(r, "methods", ())}


def router_get_paths(router: dict) -> set[str]:
    from llmserve.router.app import build_app
    from llmserve.router.gateway import Gateway
    from llmserve.router.loading import setup_from_args

    app = build_app(Gateway(setup_from_args(parse_cli(["route", *router["args"]]))))
    return {r.path for r in app.fallback.routes if "GET" in getattr(r, "methods", ())}


# ---- Dockerfiles -----------------------------------------------------------------------------------------

def _instructions(variant: str) -> list[tuple[str, str]]:
    text = (DOCKER / f"Dockerfile.{variant}").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


@pytest.mark.parametrize("variant", OVERLAYS)
def test_dockerfile(variant):
    instructions = _instructions(variant)
    last = {name: value for name, value in instructions}
    assert yaml.safe_load(last["ENTRYPOINT"]) == ["llmserve", "serve"]
    parse_cli(["serve", *yaml.safe_load(last["CMD"])])
    assert last["USER"].split(":")[0] not in ("0", "root")
    assert "/health" in last["HEALTHCHECK"]
    assert last["EXPOSE"] == "8000"
    makefile_pin = re.search(r"pip install -q (torch==\S+)", (ROOT / "Makefile").read_text()).group(1)
    runs = [shlex.split(value) for name, value in instructions if name == "RUN"]
    assert any(makefile_pin in run for run in runs), f"torch pin differs from the Makefile's {makefile_pin}"
