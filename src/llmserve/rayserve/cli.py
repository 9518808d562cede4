"""`llmserve serve-ray`: flags from EngineConfig's, ServerConfig's and RayServeConfig's dataclasses.

Starts (or joins) Ray, starts Ray Serve's HTTP proxy on --host/--port, deploys the application and waits
for SIGINT/SIGTERM, then deletes the application (and stops a Ray it started). A signal during start-up
stops what was started too, and exits 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from llmserve.config import add_dataclass_args, add_engine_args, dataclass_from_args, engine_config_from_args
from llmserve.preflight import check_before_loading
from llmserve.rayserve.config import Deployment, RayServeConfig
from llmserve.server.cli import server_config_from_args
from llmserve.server.config import ServerConfig

logger = logging.getLogger("llmserve.rayserve")


def add_serve_ray_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    add_dataclass_args(parser, ServerConfig, skip=("port",))
    parser.add_argument("--port", type=int, default=ServerConfig.port,
                        help=f"Ray Serve's HTTP proxy's TCP port, a fixed one (default: {ServerConfig.port})")
    add_dataclass_args(parser, RayServeConfig)


def add_serve_ray_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve-ray", help="serve on Ray Serve: engine replicas, autoscaling, prefix-aware request router",
        description="Deploy engine replicas as a Ray Serve application behind our OpenAI (and TGI) routes. "
                    "--host/--port are Ray Serve's HTTP proxy's.")
    add_serve_ray_args(parser)
    parser.set_defaults(func=serve_ray_command)
    return parser


def deployment_from_args(args: argparse.Namespace) -> Deployment:
    """Raises ValueError naming the flag of a bad value."""
    deployment = Deployment(engine_config_from_args(args), server_config_from_args(args),
                            dataclass_from_args(RayServeConfig, args))
    deployment.validate()
    return deployment


def serve_ray_command(args: argparse.Namespace) -> int:
    """Check every value and that Ray is installed before starting anything: exit code 2 otherwise."""
    from llmserve.rayserve import require_ray

    try:
        deployment = deployment_from_args(args)
        if deployment.ray.address is None:  # the replicas run here: their model's files can be checked now
            check_before_loading(deployment.engine)
        serve = require_ray()
    except (ValueError, ImportError) as e:
        print(f"llmserve serve-ray: error: {e} (see llmserve serve-ray --help)", file=sys.stderr)
        return 2
    return run(serve, deployment)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """SIGINT or SIGTERM before the application is up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run(serve, deployment: Deployment) -> int:
    """Serve until SIGINT/SIGTERM, then stop what was started, also when the signal comes during start-up
    (Ray's own SIGTERM handler would print a stack dump, abort, and leave Ray's agents running)."""
    import ray

    config = deployment.ray
    if config.address is None:  # a Ray of our own: its proxy and controller get the same settings
        from llmserve.rayserve.app import ray_env

        os.environ.update(ray_env(config))
    _raise_on_stop_signals()
    try:
        return _start_and_serve(serve, deployment)
    except Interrupted as e:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # a second signal does not cut the clean-up short
        print(f"llmserve serve-ray: {e} while starting: stopping", file=sys.stderr, flush=True)
        if config.address is not None and ray.is_initialized():  # a cluster we joined: our application only
            _delete_if_deployed(serve, config.app_name)
        return 128 + e.signum
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        if ray.is_initialized():
            if config.address is None:
                serve.shutdown()
            ray.shutdown()


def _start_and_serve(serve, deployment: Deployment) -> int:
    import ray

    from llmserve.rayserve.app import build_application

    config, server = deployment.ray, deployment.server
    ray.init(address=config.address, num_cpus=config.num_cpus if config.address is None else None,
             logging_level=server.log_level.upper())
    _raise_on_stop_signals()  # again: ray.init installed Ray's
    try:
        config.check_fits(ray.available_resources())
    except ValueError as e:  # before any deployment exists: nothing would be served, and Ray would wait forever
        print(f"llmserve serve-ray: error: {e}", file=sys.stderr, flush=True)
        return 2
    serve.start(http_options={"host": server.host, "port": server.port,
                              "keep_alive_timeout_s": server.timeout_keep_alive})
    serve.run(build_application(deployment), name=config.app_name, route_prefix=config.route_prefix)
    print(f"llmserve: serving on Ray Serve at http://{server.host}:{server.port}{config.route_prefix} "
          f"(application {config.app_name})", file=sys.stderr, flush=True)
    if config.direct_ingress_port is not None:
        print(f"llmserve: and without Ray's proxy at http://{server.host}:{config.direct_ingress_port}",
              file=sys.stderr, flush=True)
    _wait_for_signal()
    logger.info("stopping: deleting application %s", config.app_name)
    serve.delete(config.app_name)
    return 0


def _delete_if_deployed(serve, app_name: str) -> None:
    if app_name in serve.status().applications:
        serve.delete(app_name)


def _raise_on_stop_signals() -> None:
    def stop(signum, frame):
        raise Interrupted(signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)


def _wait_for_signal() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    signal.sigwait(set(STOP_SIGNALS))
