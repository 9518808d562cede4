"""The HTTP front's configuration: one frozen record, its CLI flags generated like the engine's."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from llmserve.config_checks import check, check_choice, check_min, parse_bytes
from llmserve.server.reasoning import REASONING_PARSERS
from llmserve.server.reasoning_grammar import parse_structured_outputs_config
from llmserve.server.tool_parsers import PARSER_NAMES

API_KEY_ENV = "LLMSERVE_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind (loopback by default)"})
    port: int = field(default=8000, metadata={"help": "TCP port (0: any free port, logged at startup)"})
    api_key: str | None = field(default=None, metadata={
        "help": f"require 'Authorization: Bearer KEY' on every route but /health, /metrics and /dashboard; "
                f"when not given, env {API_KEY_ENV}; neither: no key"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "model name clients send and see (default: the model's name)"})
    max_queued_requests: int = field(default=2048, metadata={
        "help": "engine requests allowed to wait beyond the running batch; more get 503 + Retry-After"})
    max_body_size: str = field(default="4MiB", metadata={"help": "largest request body; larger get 413"})
    shutdown_timeout: float = field(default=30.0, metadata={
        "help": "seconds SIGTERM lets in-flight requests finish before aborting them"})
    engine_startup_timeout: float = field(default=600.0, metadata={
        "help": "seconds to wait for the engine process to load the model"})
    health_stall_timeout: float = field(default=60.0, metadata={
        "help": "/health turns 503 when the engine has work but sent nothing for this long"})
    request_timeout: float | None = field(default=None, metadata={
        "help": "seconds a generation request may run (queueing included); a longer one is aborted and gets an "
                "error: HTTP 504, or an error event ending its stream (default: no limit)"})
    log_level: str = field(default="info", metadata={
        "help": "debug | info | warning | error", "choices": ["debug", "info", "warning", "error"]})
    access_log: bool = field(default=False, metadata={"help": "log one line per HTTP request"})
    timeout_keep_alive: int = field(default=75, metadata={
        "help": "seconds an idle keep-alive connection stays open; keep it above the clients' (and load balancers') "
                "idle timeouts: a request sent as the server closes the connection gets a reset, unlogged"})
    stream_interval: int = field(default=1, metadata={
        "help": "a stream sends a sequence's tokens in events of this many (its first token and its end at "
                "once): fewer events cost the front less CPU under load, at coarser streaming"})
    tool_call_parser: str | None = field(default=None, metadata={
        "help": "how tool calls are read from the model's text under tool_choice 'auto': hermes "
                "(<tool_call>{...}</tool_call>: Qwen, Hermes), llama3_json ({\"name\": ..., \"parameters\": ...}: "
                "Llama 3.x), mistral ([TOOL_CALLS][...]), openai (gpt-oss's harmony messages to=functions.NAME; with "
                "--reasoning-parser gpt_oss); default: chosen by the markers the chat template mentions",
        "choices": list(PARSER_NAMES)})
    grpc_port: int | None = field(default=None, metadata={
        "help": "serve the gRPC API (llmserve.proto's Generation service) on this port too, same host, engine "
                "and API key (0: any free port, logged at startup); default: HTTP only"})
    reasoning_parser: str | None = field(default=None, metadata={
        "help": "return a thinking model's thoughts apart from its answer (chat's reasoning_content, the Responses "
                "API's reasoning item): deepseek_r1 (the template opens <think>), qwen3 (the model writes "
                "<think>...</think>), gpt_oss (harmony's analysis channel); default: thoughts stay in the content",
        "choices": list(REASONING_PARSERS)})
    structured_outputs_config: str | None = field(default=None, metadata={
        "help": "JSON: enable_in_reasoning (true: a grammar constrains the thoughts too; default false: with "
                "--reasoning-parser it starts after the end of the thoughts, as vLLM's)"})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check(bool(self.host), "host", "must not be empty")
        check(0 <= self.port < 65536, "port", f"must be in 0..65535, got {self.port}")
        check(self.served_model_name != "", "served-model-name", "must not be empty")
        check_min("max-queued-requests", self.max_queued_requests, 0)
        check(parse_bytes(self.max_body_size, "max-body-size") > 0, "max-body-size",
              f"must be positive, got {self.max_body_size!r}")
        check_min("shutdown-timeout", self.shutdown_timeout, 0)
        check(self.engine_startup_timeout > 0, "engine-startup-timeout",
              f"must be > 0, got {self.engine_startup_timeout}")
        check(self.health_stall_timeout > 0, "health-stall-timeout", f"must be > 0, got {self.health_stall_timeout}")
        check_min("timeout-keep-alive", self.timeout_keep_alive, 0)
        check_min("stream-interval", self.stream_interval, 1)
        if self.tool_call_parser is not None:
            check_choice("tool-call-parser", self.tool_call_parser, PARSER_NAMES)
        check(self.grpc_port is None or 0 <= self.grpc_port <= 65535, "grpc-port",
              f"must be in [0, 65535], got {self.grpc_port}")
        if self.reasoning_parser is not None:
            check_choice("reasoning-parser", self.reasoning_parser, REASONING_PARSERS)
        parse_structured_outputs_config(self.structured_outputs_config)  # ValueError naming the flag
        check(self.request_timeout is None or self.request_timeout > 0, "request-timeout",
              f"must be > 0, got {self.request_timeout}")

    @property
    def is_grammar_in_reasoning(self) -> bool:
        return parse_structured_outputs_config(self.structured_outputs_config).get("enable_in_reasoning", False)

    @property
    def num_max_body_bytes(self) -> int:
        return parse_bytes(self.max_body_size)


def resolve_api_key(flag_value: str | None) -> str | None:
    """The flag wins; else the environment; an empty string means no key."""
    key = flag_value if flag_value is not None else os.environ.get(API_KEY_ENV)
    return key or None
