"""Run the prefill/decode router (router/pd.py) with uvicorn: `llmserve route --pd-disaggregation`."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from llmserve.http.launch import bind_socket, run_service
from llmserve.router.config import RouterConfig
from llmserve.router.pd import PDConfig, PDRouter, build_pd_app
from llmserve.router.pd_policy import PDPolicy

logger = logging.getLogger("llmserve.router.pd")
# The gateway's flags a P/D router takes; any other one set is refused rather than ignored.
PD_ROUTER_FLAGS = ("host", "port", "upstream_timeout_s", "log_level")


def pd_config_from_args(args: argparse.Namespace) -> PDConfig:
    if not args.pd_disaggregation:
        raise ValueError("--prefill / --decode / --max-local-prefill-length(-if-busy) / --prefill-on-idle-decode: only "
                         "with --pd-disaggregation")
    if args.backend or args.config:
        raise ValueError("--pd-disaggregation takes --prefill and --decode servers, not --backend or --config")
    defaults = RouterConfig()
    unsupported = [name for name in vars(defaults) if name not in PD_ROUTER_FLAGS
                   and getattr(args, name, getattr(defaults, name)) != getattr(defaults, name)]
    if unsupported or getattr(args, "autoscale", False):
        names = ", ".join("--" + n.replace("_", "-") for n in unsupported) or "--autoscale"
        raise ValueError(f"{names}: not supported with --pd-disaggregation yet")
    return PDConfig(tuple(u.rstrip("/") for u in args.prefill), tuple(u.rstrip("/") for u in args.decode),
                    upstream_timeout_s=args.upstream_timeout_s,
                    policy=PDPolicy(args.max_local_prefill_length, args.max_local_prefill_length_if_busy,
                                    args.prefill_on_idle_decode))


async def serve_pd(config: PDConfig, host: str, port: int, log_level: str) -> int:
    sock = bind_socket(host, port)
    router = PDRouter(config)
    app = build_pd_app(router)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off"))
    logger.info("routing prefill %s / decode %s on http://%s:%d", ", ".join(config.prefill_urls),
                ", ".join(config.decode_urls), host, sock.getsockname()[1])
    try:
        await server.serve(sockets=[sock])
    finally:
        await router.upstream.aclose()
        sock.close()
    return 0


def run_pd(config: PDConfig, host: str, port: int, log_level: str) -> int:
    return run_service(serve_pd(config, host, port, log_level), log_level, logger)
