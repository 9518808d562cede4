"""The Ray Serve application: engine replicas (replica.py) behind the ingress (ingress.py); with
--pd-disaggregation, prefill and decode replicas behind the P/D ingress (pd_ingress.py).

`build_application(deployment)` for Python and `llmserve serve-ray`; `build_app` for Ray's own CLI:

    serve run llmserve.rayserve.app:build_app model=/path/to/model dtype=float32 min-replicas=2

(each key=value is the `llmserve serve-ray` flag of that name, so defaults and checks are the same).
"""

from __future__ import annotations

import argparse

from llmserve.rayserve import require_ray
from llmserve.rayserve.config import PREFIX_AWARE, Deployment, RayServeConfig
from llmserve.rayserve.ingress import Ingress
from llmserve.rayserve.pd_ingress import PDIngress
from llmserve.rayserve.replica import LLMReplica

REPLICA_DEPLOYMENT, INGRESS_DEPLOYMENT = "LLMReplica", "Ingress"
PREFILL_DEPLOYMENT, DECODE_DEPLOYMENT = "LLMPrefill", "LLMDecode"  # --pd-disaggregation's engine deployments
INGRESS_MAX_ONGOING = 16384  # the ingress only forwards: its limit must not be the bottleneck (Ray's default is 5)
ROUTER_CLASS = "llmserve.rayserve.request_router:PrefixAwareRequestRouter"
ROUTING_STATS_PERIOD_S = 2.0  # how often the router hears each replica's adapters (an adapter loaded at run time)
# Ray Serve runs user code on a second event loop in its own thread, and a handle's router on a third, by
# default: every streamed item then hops between threads. Both on Ray's main loops (in every Ray process) is
# faster through Ray (docs/benchmarks.md, "Ray Serve").
SAME_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
# --direct-ingress-port: Ray 2.60's "throughput optimized" preset (the above, handle calls over gRPC instead of
# Ray actor tasks, GC frozen after start, a buffered request-path log; Ray's logs still go to stderr) with
# direct ingress: together they come closest to `llmserve serve` direct, either alone does not
# (docs/benchmarks.md, "Ray Serve").
THROUGHPUT_ENV = {**SAME_LOOP_ENV, "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_LOG_TO_STDERR": "1"}


def ray_env(config: RayServeConfig) -> dict[str, str]:
    """The environment of every Ray process (local Ray) or of our deployments' replicas (joined cluster).
    Direct ingress: the ingress replica's own HTTP server on --direct-ingress-port (the next ports for more
    ingress replicas on a node); a replaced replica takes its port back at once, and a stopping one does not
    hold the port for Ray's default 30 s load-balancer draining (it still waits for its open requests)."""
    if config.direct_ingress_port is None:
        return SAME_LOOP_ENV
    port = config.direct_ingress_port
    return {**THROUGHPUT_ENV, "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + config.ingress_replicas),
            "RAY_SERVE_PORT_QUARANTINE_S": "0", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


def logging_config(deployment: Deployment) -> dict:
    """Ray's per-request log lines follow --access-log (off by default: a line per request costs CPU)."""
    server = deployment.server
    return {"enable_access_log": server.access_log, "log_level": server.log_level.upper()}


def replica_options(deployment: Deployment, name: str = REPLICA_DEPLOYMENT, role: str | None = None) -> dict:
    """An engine deployment's options: --num-replicas fixed, else autoscaling (--pd-disaggregation: `role`'s)."""
    config = deployment.ray
    num_replicas = config.num_replicas if role is None else config.role_num_replicas(role)
    options = {"name": name, "logging_config": logging_config(deployment),
               "max_ongoing_requests": config.max_ongoing_requests,
               "ray_actor_options": {"num_cpus": config.replica_num_cpus, "num_gpus": config.replica_num_gpus,
                                     "runtime_env": {"env_vars": ray_env(config)}},
               "graceful_shutdown_timeout_s": deployment.server.shutdown_timeout,
               "health_check_timeout_s": deployment.server.health_stall_timeout}
    if num_replicas is not None:
        options["num_replicas"] = num_replicas
    else:
        options["autoscaling_config"] = config.autoscaling_config(role)
    if config.request_router == PREFIX_AWARE:
        from ray.serve.config import RequestRouterConfig

        options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER_CLASS, request_router_kwargs={"load_factor": config.load_factor},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    return options


def build_application(deployment: Deployment):
    """The bound application (checked first: a bad value fails here, not in a replica)."""
    deployment.validate()
    serve = require_ray()
    if deployment.ray.pd_disaggregation:
        return _pd_application(serve, deployment)
    replicas = serve.deployment(LLMReplica).options(**replica_options(deployment)).bind(deployment)
    return _ingress(serve, Ingress, deployment).bind(replicas, deployment)


def _pd_application(serve, deployment: Deployment):
    """--pd-disaggregation: a prefill and a decode deployment (engines of that --disaggregation-mode, each
    autoscaled by its own flags or a fixed count) behind the P/D ingress (pd_ingress.py)."""
    roles = {}
    for role, name in (("prefill", PREFILL_DEPLOYMENT), ("decode", DECODE_DEPLOYMENT)):
        role_deployment = deployment.for_role(role)
        roles[role] = serve.deployment(LLMReplica).options(
            **replica_options(role_deployment, name, role)).bind(role_deployment)
    return _ingress(serve, PDIngress, deployment).bind(roles["decode"], roles["prefill"], deployment)


def _ingress(serve, ingress_class: type, deployment: Deployment):
    ingress_resources = {"num_cpus": deployment.ray.ingress_num_cpus, "runtime_env": {"env_vars": ray_env(deployment.ray)}}
    return serve.deployment(ingress_class).options(
        name=INGRESS_DEPLOYMENT, num_replicas=deployment.ray.ingress_replicas, max_ongoing_requests=INGRESS_MAX_ONGOING,
        logging_config=logging_config(deployment), ray_actor_options=ingress_resources)


def build_app(args: dict[str, str]):
    """For `serve run llmserve.rayserve.app:build_app key=value ...`: the serve-ray flags, without dashes."""
    from llmserve.rayserve.cli import add_serve_ray_args, deployment_from_args

    parser = argparse.ArgumentParser(prog="serve run llmserve.rayserve.app:build_app", exit_on_error=False)
    add_serve_ray_args(parser)
    return build_application(deployment_from_args(parser.parse_args(_argv(args))))


def _argv(args: dict[str, str]) -> list[str]:
    """{"min-replicas": "2", "enforce_eager": "true"} -> ["--min-replicas", "2", "--enforce-eager"]."""
    argv = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        text = str(value).lower()
        if text in ("true", "false"):
            argv.append(flag if text == "true" else f"--no-{flag[2:]}")
        else:
            argv += [flag, str(value)]
    return argv
