"""The Ray Serve deployment's configuration: one frozen record (defaults stated here once), its CLI flags
generated from it like the engine's and the server's, checked before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from llmserve.config import DEFAULT_KV_PORT, EngineConfig
from llmserve.config_checks import check, check_choice, check_min
from llmserve.router.pd_policy import PDPolicy
from llmserve.router.requests import PrefixConfig
from llmserve.server.config import ServerConfig

PREFIX_AWARE, POW_2 = "prefix-aware", "pow-2"
ROUTER_NAMES = (PREFIX_AWARE, POW_2)
PD_ROLES = ("prefill", "decode")
# The one engine deployment's replica flags; with --pd-disaggregation each role has its own (PD_ROLE_FIELDS)
# and shares the delays and the look-back period.
REPLICA_FIELDS = ("num_replicas", "min_replicas", "max_replicas", "initial_replicas", "target_ongoing_requests")
PD_ROLE_FIELDS = ("num_{}_replicas", "{}_min_replicas", "{}_max_replicas", "{}_target_ongoing_requests")
PD_POLICY_FIELDS = ("max_local_prefill_length", "max_local_prefill_length_if_busy", "prefill_on_idle_decode")


@dataclass(frozen=True)
class RayServeConfig:
    address: str | None = field(default=None, metadata={
        "help": "Ray cluster to join (e.g. auto, ray://head:10001); default: start a local Ray on this machine"})
    num_cpus: int | None = field(default=None, metadata={
        "help": "local Ray only: CPUs it may schedule (default: Ray's count of this machine's)"})
    direct_ingress_port: int | None = field(default=None, metadata={
        "help": "local Ray only: the ingress also serves HTTP itself on this port (the next ones for more "
                "--ingress-replicas), without Ray's proxy on the way (Ray 2.60's direct ingress, experimental: "
                "closer to `llmserve serve`'s throughput than the proxy); --port keeps the proxy"})
    app_name: str = field(default="llmserve", metadata={"help": "Ray Serve application name"})
    route_prefix: str = field(default="/", metadata={"help": "the application's path on Ray's HTTP proxy"})
    num_replicas: int | None = field(default=None, metadata={
        "help": "a fixed number of engine replicas (autoscaling off); default: autoscale between "
                "--min-replicas and --max-replicas"})
    min_replicas: int = field(default=1, metadata={"help": "autoscaling: fewest engine replicas"})
    max_replicas: int = field(default=4, metadata={"help": "autoscaling: most engine replicas"})
    initial_replicas: int | None = field(default=None, metadata={
        "help": "autoscaling: replicas at start (default: --min-replicas)"})
    target_ongoing_requests: float = field(default=64.0, metadata={
        "help": "autoscaling: requests running or queued per replica that Ray aims at (half a CPU batch of "
                "128 sequences): above it for --upscale-delay-s adds replicas"})
    upscale_delay_s: float = field(default=10.0, metadata={"help": "autoscaling: seconds above target before adding"})
    downscale_delay_s: float = field(default=60.0, metadata={
        "help": "autoscaling: seconds below target before removing a replica"})
    look_back_period_s: float = field(default=15.0, metadata={
        "help": "autoscaling: seconds over which Ray averages the ongoing requests (Ray 2.60 warns at 10 or "
                "less: it must exceed Ray's metrics interval, 10 s)"})
    max_ongoing_requests: int = field(default=256, metadata={
        "help": "requests one replica holds at once (running + its engine's queue); more wait in the ingress"})
    replica_num_cpus: float = field(default=1.0, metadata={"help": "CPUs Ray reserves per engine replica"})
    replica_num_gpus: float = field(default=0.0, metadata={
        "help": "GPUs Ray reserves per engine replica (1 for --device cuda; Ray sets CUDA_VISIBLE_DEVICES)"})
    ingress_replicas: int = field(default=1, metadata={
        "help": "ingress replicas (each keeps its own prefix table: more than one weakens prefix affinity)"})
    ingress_num_cpus: float = field(default=0.5, metadata={"help": "CPUs Ray reserves per ingress replica"})
    request_router: str = field(default=PREFIX_AWARE, metadata={
        "help": "prefix-aware (our policy: a prefix stays on one replica under a load bound) | pow-2 (Ray's "
                "default: the shorter queue of two random replicas)", "choices": list(ROUTER_NAMES)})
    load_factor: float = field(default=1.0, metadata={
        "help": "prefix-aware: epsilon of the bounded load; no replica takes more than (1+eps) x its share"})
    prefix_chars: int = field(default=256, metadata={"help": "prefix-aware: leading prompt characters hashed"})
    prefix_tokens: int = field(default=64, metadata={"help": "prefix-aware: leading token ids hashed (id prompts)"})
    max_attempts: int = field(default=3, metadata={
        "help": "ingress: tries of a request whose replica died before answering anything"})
    pd_disaggregation: bool = field(default=False, metadata={
        "help": "prefill/decode disaggregation: prefill replicas compute each prompt and send its KV blocks to a "
                "decode replica, which streams the answer (docs/disaggregation.md); each role autoscales by its "
                "own flags (--prefill-*, --decode-*) or runs a fixed count"})
    num_prefill_replicas: int | None = field(default=None, metadata={
        "help": "--pd-disaggregation: a fixed number of prefill replicas; default: autoscale between "
                "--prefill-min-replicas and --prefill-max-replicas"})
    prefill_min_replicas: int = field(default=1, metadata={"help": "--pd-disaggregation: fewest prefill replicas"})
    prefill_max_replicas: int = field(default=4, metadata={"help": "--pd-disaggregation: most prefill replicas"})
    prefill_target_ongoing_requests: float = field(default=2.0, metadata={
        "help": "--pd-disaggregation: prompts in flight per prefill replica that Ray aims at (one prompt keeps a "
                "replica's compute busy; more queue)"})
    num_decode_replicas: int | None = field(default=None, metadata={
        "help": "--pd-disaggregation: a fixed number of decode replicas; default: autoscale between "
                "--decode-min-replicas and --decode-max-replicas"})
    decode_min_replicas: int = field(default=1, metadata={"help": "--pd-disaggregation: fewest decode replicas"})
    decode_max_replicas: int = field(default=4, metadata={"help": "--pd-disaggregation: most decode replicas"})
    decode_target_ongoing_requests: float = field(default=64.0, metadata={
        "help": "--pd-disaggregation: requests decoding or queued per decode replica that Ray aims at"})
    max_local_prefill_length: int = field(default=0, metadata={
        "help": "--pd-disaggregation: prompts of at most N tokens skip the prefill replicas (computed by the "
                "decode replica; Dynamo's name, as `llmserve route`'s); 0: off"})
    max_local_prefill_length_if_busy: int = field(default=0, metadata={
        "help": "--pd-disaggregation: a prompt of at most N tokens is computed by the decode replica when every "
                "prefill replica is computing a longer prompt (as `llmserve route`'s); 0: off"})
    prefill_on_idle_decode: bool = field(default=False, metadata={
        "help": "--pd-disaggregation: a decode replica with nothing in flight computes a prompt itself when every "
                "prefill replica has one in flight (as `llmserve route`'s)"})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check(bool(self.app_name), "app-name", "must not be empty")
        check(self.route_prefix.startswith("/"), "route-prefix", f"must start with /, got {self.route_prefix!r}")
        check_min("num-cpus", self.num_cpus, 1)
        if self.direct_ingress_port is not None:
            check(self.address is None, "direct-ingress-port", "needs a local Ray (no --address): Ray's "
                  "controller must start with direct ingress on")
            check(1 <= self.direct_ingress_port <= 65535 - self.ingress_replicas, "direct-ingress-port",
                  f"must be a port in 1..{65535 - self.ingress_replicas}, got {self.direct_ingress_port}")
        check_min("num-replicas", self.num_replicas, 1)
        check_min("min-replicas", self.min_replicas, 0)
        check(self.max_replicas >= max(1, self.min_replicas), "max-replicas",
              f"must be >= 1 and >= --min-replicas ({self.min_replicas}), got {self.max_replicas}")
        if self.initial_replicas is not None:
            check(self.min_replicas <= self.initial_replicas <= self.max_replicas, "initial-replicas",
                  f"must be in --min-replicas..--max-replicas, got {self.initial_replicas}")
        for name in ("target_ongoing_requests", "look_back_period_s"):
            check(getattr(self, name) > 0, name.replace("_", "-"), f"must be > 0, got {getattr(self, name)}")
        for name in ("upscale_delay_s", "downscale_delay_s", "replica_num_cpus", "replica_num_gpus",
                     "ingress_num_cpus", "load_factor"):
            check_min(name.replace("_", "-"), getattr(self, name), 0)
        for name in ("max_ongoing_requests", "ingress_replicas", "prefix_chars", "prefix_tokens", "max_attempts"):
            check_min(name.replace("_", "-"), getattr(self, name), 1)
        check_choice("request-router", self.request_router, ROUTER_NAMES)
        if self.pd_disaggregation:
            self._check_pd()
            return
        defaults = {f.name: f.default for f in fields(self)}
        pd_fields = (*(name.format(role) for role in PD_ROLES for name in PD_ROLE_FIELDS), *PD_POLICY_FIELDS)
        for name in pd_fields:
            check(getattr(self, name) == defaults[name], name.replace("_", "-"), "only with --pd-disaggregation")

    def _check_pd(self) -> None:
        """P/D sizes each role by its own flags, and pins each request's decode call to the replica its blocks
        went to, which only our request router honours."""
        check(self.request_router == PREFIX_AWARE, "request-router",
              f"--pd-disaggregation needs {PREFIX_AWARE} (it pins each request to the decode replica holding its "
              f"KV blocks; {POW_2} cannot), got {self.request_router}")
        defaults = {f.name: f.default for f in fields(self)}
        for name in REPLICA_FIELDS:
            check(getattr(self, name) == defaults[name], name.replace("_", "-"),
                  "not with --pd-disaggregation: each role has its own (--num-prefill-replicas or "
                  "--prefill-min-replicas / --prefill-max-replicas / --prefill-target-ongoing-requests, and "
                  "--decode-* the same)")
        for role in PD_ROLES:
            num, low, high, target = (getattr(self, name.format(role)) for name in PD_ROLE_FIELDS)
            check_min(f"num-{role}-replicas", num, 1)
            check_min(f"{role}-min-replicas", low, 1)  # the ingress needs a replica of each role to route to
            check(high >= low, f"{role}-max-replicas", f"must be >= --{role}-min-replicas ({low}), got {high}")
            check(target > 0, f"{role}-target-ongoing-requests", f"must be > 0, got {target}")
        self.pd_policy  # noqa: B018 (checks the lengths)

    @property
    def pd_policy(self) -> PDPolicy:
        """--pd-disaggregation's placement rules, the P/D router's (router/pd_policy.py)."""
        return PDPolicy(self.max_local_prefill_length, self.max_local_prefill_length_if_busy,
                        self.prefill_on_idle_decode)

    def role_num_replicas(self, role: str) -> int | None:
        """A role's fixed replica count; None: it autoscales."""
        return getattr(self, f"num_{role}_replicas")

    @property
    def replicas_flag(self) -> str:
        """The flag(s) that set how many engine replicas start (named when they do not fit)."""
        if self.pd_disaggregation:
            return " / --".join(f"num-{role}-replicas" if self.role_num_replicas(role) is not None
                                else f"{role}-min-replicas" for role in PD_ROLES)
        return "num-replicas" if self.num_replicas is not None else \
            "initial-replicas" if self.initial_replicas is not None else "min-replicas"

    @property
    def num_starting_replicas(self) -> int:
        """Engine replicas Ray creates at start: --num-replicas, else --initial-replicas or --min-replicas
        (--pd-disaggregation: the prefill and the decode replicas)."""
        if self.pd_disaggregation:
            return sum(self.role_num_replicas(role) or getattr(self, f"{role}_min_replicas") for role in PD_ROLES)
        for num in (self.num_replicas, self.initial_replicas):
            if num is not None:
                return num
        return self.min_replicas

    def check_fits(self, available: dict[str, float]) -> None:
        """The CPUs and GPUs the deployments reserve at start against what the Ray cluster has free
        (`ray.available_resources()`): a replica that does not fit waits forever, so say which flag to lower."""
        num, replicas_flag = self.num_starting_replicas, self.replicas_flag
        cpus = num * self.replica_num_cpus + self.ingress_replicas * self.ingress_num_cpus
        free_cpus = available.get("CPU", 0.0)
        more = ", or give Ray more with --num-cpus" if self.address is None else ""
        check(cpus <= free_cpus + 1e-9, replicas_flag,
              f"{num} engine replica(s) x {self.replica_num_cpus:g} CPU (--replica-num-cpus) + "
              f"{self.ingress_replicas} ingress x {self.ingress_num_cpus:g} CPU (--ingress-num-cpus) = {cpus:g} "
              f"CPUs, but the Ray cluster has {free_cpus:g} free: lower --{replicas_flag} or those{more}")
        gpus, free_gpus = num * self.replica_num_gpus, available.get("GPU", 0.0)
        check(gpus <= free_gpus + 1e-9, replicas_flag,
              f"{num} engine replica(s) x {self.replica_num_gpus:g} GPU (--replica-num-gpus) = {gpus:g} GPUs, "
              f"but the Ray cluster has {free_gpus:g} free: lower --{replicas_flag} or --replica-num-gpus")

    @property
    def prefix(self) -> PrefixConfig:
        return PrefixConfig(self.prefix_chars, self.prefix_tokens)

    def autoscaling_config(self, role: str | None = None) -> dict | None:
        """Ray Serve's autoscaling_config of the engine deployment, or with --pd-disaggregation of `role`'s
        (None when that one runs a fixed count): on requests ongoing per replica, the delays shared."""
        if self.pd_disaggregation != (role is not None):
            return None
        if role is None:
            if self.num_replicas is not None:
                return None
            low, high, initial, target = (self.min_replicas, self.max_replicas, self.initial_replicas,
                                          self.target_ongoing_requests)
        else:
            if self.role_num_replicas(role) is not None:
                return None
            low, high, target = (getattr(self, f"{role}_{name}") for name in
                                 ("min_replicas", "max_replicas", "target_ongoing_requests"))
            initial = None
        return {"min_replicas": low, "max_replicas": high, "initial_replicas": initial,
                "target_ongoing_requests": target, "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s, "look_back_period_s": self.look_back_period_s}


@dataclass(frozen=True)
class Deployment:
    """Everything a replica and the ingress need (pickled by Ray to every replica)."""

    engine: EngineConfig
    server: ServerConfig
    ray: RayServeConfig

    def validate(self) -> None:
        self.engine.validate()
        self.server.validate()
        self.ray.validate()
        check(self.server.port != 0, "port", "Ray Serve's proxy needs a fixed port, got 0")
        direct = self.ray.direct_ingress_port
        check(direct is None or not direct <= self.server.port < direct + self.ray.ingress_replicas,
              "direct-ingress-port", f"its ports must not include --port ({self.server.port})")
        device = self.engine.model.device
        check(not (device.startswith("cuda") and self.ray.replica_num_gpus == 0), "replica-num-gpus",
              f"--device {device} needs a GPU per replica: give --replica-num-gpus 1")
        if self.ray.pd_disaggregation:
            self._check_pd()

    def _check_pd(self) -> None:
        """The roles are the option's to set; each role's engine config must hold (prefix caching, no tensor
        parallelism, no draft model), checked as `llmserve serve --disaggregation-mode` would."""
        kv = self.engine.kv_transfer
        check(kv.disaggregation_mode == "null", "disaggregation-mode",
              "not with --pd-disaggregation, which starts the prefill and the decode replicas itself")
        check(kv.disaggregation_kv_port == DEFAULT_KV_PORT, "disaggregation-kv-port",
              "not with --pd-disaggregation: each decode replica binds a free port and reports it")
        for role in PD_ROLES:
            try:
                self.for_role(role).engine.validate()
            except ValueError as e:
                raise ValueError(f"--pd-disaggregation: its {role} replicas: {e}") from None

    def for_role(self, role: str) -> Deployment:
        """The deployment record of --pd-disaggregation's prefill or decode replicas: the engine with that
        --disaggregation-mode (a decode replica's KV port: any free one, which it reports)."""
        kv = replace(self.engine.kv_transfer, disaggregation_mode=role,
                     disaggregation_kv_port=0 if role == "decode" else DEFAULT_KV_PORT)
        return replace(self, engine=replace(self.engine, kv_transfer=kv))
