"""The cluster spec as typed data.

Protocol: a spec is parsed once (``spec.load``), validated field by field here
(pydantic, ``extra="forbid"`` so a typo is an error, not a silent default) and then
across fields (``spec.checks``). Everything downstream — launchers, the hub's topology,
the CLI — reads only these models, never the raw YAML.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator, model_validator

from ..hub.defaults import MUSTER_S
from ..names import MODEL_PATTERN

# Names end up in file paths, ZeroMQ identities and metric labels: keep them plain.
# One rule for every name, models' included (``names``).
Name = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=MODEL_PATTERN)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HubSpec(Strict):
    node: Optional[str] = Field(
        default=None,
        description="node that runs the hub (required, except with launcher 'ray': a node's name or address; "
                    "default the Ray head node)",
    )
    port: int = Field(default=7700, ge=1, le=65535)
    metrics_port: Optional[int] = Field(
        default=None, ge=1, le=65535, description="prometheus /metrics; off when absent"
    )
    heartbeat_s: float = Field(default=1.0, gt=0, le=60, description="endpoint heartbeat period")
    expiry_s: float = Field(
        default=5.0, gt=0, le=600, description="silence after which an endpoint is expired"
    )
    muster_s: float = Field(
        default=MUSTER_S, ge=0, le=10, description="a new swarm's first readers asking within this long are chained "
                                               "together by rack and node (0: each placed as it asks)"
    )

    @model_validator(mode="after")
    def _expiry_covers_heartbeats(self) -> "HubSpec":
        require_beats(self.expiry_s, self.heartbeat_s, "node")
        return self


def require_beats(expiry_s: float, heartbeat_s: float, what: str) -> None:
    """The hub's expiry must outlast two heartbeats (contract 6), else one late beat
    expires a live ``what``: a spec's hub and the simulator's hub are held to it alike."""
    if expiry_s < 2 * heartbeat_s:
        raise ValueError(f"expiry_s must be at least twice heartbeat_s, or one late beat expires a live {what}")


class AuthSpec(Strict):
    token: Optional[str] = Field(default=None, min_length=16, description="inline cluster token")
    token_file: Optional[str] = Field(default=None, description="file holding the token, relative to the spec")

    @model_validator(mode="after")
    def _one_source(self) -> "AuthSpec":
        if self.token is not None and self.token_file is not None:
            raise ValueError("give token or token_file, not both")
        return self


class SshSpec(Strict):
    user: Optional[str] = None
    port: Optional[int] = Field(default=None, ge=1, le=65535)
    key_file: Optional[str] = None
    known_hosts: Optional[str] = None
    strict_host_keys: Optional[bool] = None
    connect_timeout_s: Optional[float] = Field(default=None, gt=0, le=300)


class SshDefaults(SshSpec):
    port: Optional[int] = Field(default=22, ge=1, le=65535)
    known_hosts: Optional[str] = "~/.ssh/known_hosts"
    strict_host_keys: Optional[bool] = True
    connect_timeout_s: Optional[float] = Field(default=10.0, gt=0, le=300)


class Bootstrap(Strict):
    python: Optional[str] = Field(default=None, description="python executable on the node")
    prefix: Optional[str] = Field(
        default=None, description="shell prefix run before python, e.g. 'source ~/venv/bin/activate &&'"
    )


# A UCX device list as UCX_NET_DEVICES takes it: names with an optional port, by commas.
UCX_DEVICES = re.compile(r"[A-Za-z0-9_.-]+(:[0-9]+)?(,[A-Za-z0-9_.-]+(:[0-9]+)?)*")


class NodeSpec(Strict):
    name: Name
    address: str = Field(min_length=1, max_length=253)
    gpus: int = Field(default=0, ge=0, le=64)
    nic_gbps: float = Field(default=10.0, gt=0, le=10000)
    labels: dict[str, str] = Field(default_factory=dict)
    spot: bool = False
    ssh: Optional[SshSpec] = None
    bootstrap: Optional[Bootstrap] = None
    ucx_net_devices: Optional[Union[str, list[str]]] = Field(
        default=None,
        description="the NICs UCX may use on this node (UCX_NET_DEVICES, e.g. 'mlx5_0:1'): one device list for "
                    "every process of the node, or a list of one entry per GPU (entry i: GPU i's NIC, so each "
                    "process reads over the NIC next to its GPU); a UCX_NET_DEVICES already in a process's "
                    "environment wins",
    )

    @field_validator("ucx_net_devices", mode="before")
    @classmethod
    def _ucx_devices(cls, value: object, info: ValidationInfo) -> object:
        # Before pydantic's own union check: its errors would name the union's arms.
        if value is None:
            return value
        entries = value if isinstance(value, list) else [value]
        if not isinstance(value, (str, list)) or not entries:
            raise ValueError("takes a UCX device list ('mlx5_0:1') or a list of one per GPU")
        for i, entry in enumerate(entries):
            if not isinstance(entry, str) or not UCX_DEVICES.fullmatch(entry):
                where = f"entry {i}: " if isinstance(value, list) else ""
                raise ValueError(f"{where}{entry!r} is not a UCX device list (names with an optional :port, "
                                 "separated by commas, e.g. 'mlx5_0:1')")
        gpus = info.data.get("gpus")
        if isinstance(value, list) and gpus is not None and len(value) != gpus:
            raise ValueError(f"lists {len(value)} entries, one per GPU, but the node has gpus: {gpus} "
                             "(one device list for the whole node is a plain string)")
        return value


class RackSpec(Strict):
    name: Name
    nodes: list[NodeSpec] = Field(min_length=1)


class DatacenterSpec(Strict):
    name: Name
    racks: list[RackSpec] = Field(min_length=1)


class LinkSpec(Strict):
    between: tuple[str, str] = Field(description="the two datacenters this link joins")
    gbps: float = Field(gt=0, le=10000)
    rtt_ms: float = Field(default=0.0, ge=0, le=10000)


class TopologySpec(Strict):
    datacenters: list[DatacenterSpec] = Field(min_length=1)
    links: list[LinkSpec] = Field(default_factory=list)


class Selector(Strict):
    nodes: Optional[list[str]] = Field(default=None, description="node names")
    labels: Optional[dict[str, str]] = Field(default=None, description="labels a node must all carry")


class Runner(Strict):
    command: str = Field(min_length=1)
    args: list[str] = Field(default_factory=list)


class RestartSpec(Strict):
    """What a runner's supervisor (``agent.supervise``) does when the runner exits."""

    policy: Literal["on-failure", "always", "never"] = Field(
        default="on-failure",
        description="on-failure: restart unless it exited 0 (a trainer that finished its steps); "
                    "always: restart whatever its exit; never: leave it dead",
    )
    max_restarts: int = Field(default=5, ge=0, le=10000, description="restarts allowed within window_s")
    window_s: float = Field(default=600.0, gt=0, le=86400.0, description="the window max_restarts counts in")
    backoff_s: float = Field(default=1.0, ge=0, le=600.0,
                             description="wait before the first restart; doubles per restart in the window, "
                                         "capped at 60 s")


class RoleSpec(Strict):
    count: int = Field(ge=0, le=100000, description="runners `th up` starts (then `th scale` changes it)")
    restart: RestartSpec = Field(default_factory=RestartSpec, description="what happens when a runner exits")
    select: Selector = Field(default_factory=Selector, description="which nodes may run this role")
    runner: Optional[Runner] = None
    group_size: int = Field(default=1, ge=1, le=4096, description="ranks per model-parallel instance")


class RetainSpec(Strict):
    keep_latest: int = Field(default=2, ge=1, le=1000)
    min_reliable_copies: int = Field(default=1, ge=0, le=1000)


class ModelSpec(Strict):
    name: Name
    chunk_mb: float = Field(default=16.0, gt=0, le=4096)
    retain: RetainSpec = Field(default_factory=RetainSpec)
    deltas: Literal["off", "remote", "all"] = Field(
        default="remote", description="reads sent as deltas against a version both ends hold: "
        "remote (across DC links), all (every read) or off")


class EndpointsSpec(Strict):
    """How long endpoints wait on the network and on each other before giving up."""

    read_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="one chunk read; past it the read is reported failed and re-planned from another source",
    )
    plan_timeout_s: float = Field(
        default=5.0, gt=0, le=600, description="one plan round trip to the hub"
    )
    drain_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=86400,
        description=(
            "per replica: how long an endpoint that leaves (scale-down, failover) waits for its "
            "unpublish drain and retention copy before it is stopped anyway"
        ),
    )


class RaySpec(Strict):
    """Where the Ray cluster is (``launcher: ray``) and how its nodes are placed."""

    address: str = Field(default="auto", min_length=1,
                         description="the Ray cluster to join, as ray.init takes it: 'auto' (the one this "
                                     "machine is a node of) or HOST:PORT of its head's GCS")
    namespace: Name = Field(default="tensorhub", description="the Ray namespace of the cluster's actors")
    node_label: str = Field(default="tensorhub.io/node", min_length=1,
                            description="Ray node label naming the TensorHub node (default: ray-<IP>)")
    rack_label: str = Field(default="tensorhub.io/rack", min_length=1,
                            description="Ray node label (or custom resource 'LABEL=VALUE') giving the rack")
    dc_label: str = Field(default="tensorhub.io/dc", min_length=1,
                          description="Ray node label (or custom resource 'LABEL=VALUE') giving the datacenter")
    follow_s: float = Field(default=1.0, gt=0, le=60,
                            description="how often the cluster looks for Ray nodes that joined or left")
    start_timeout_s: float = Field(default=60.0, gt=0, le=3600,
                                   description="one actor scheduled and its process started")


class ClusterSpec(Strict):
    name: Name
    hub: HubSpec
    auth: AuthSpec = Field(default_factory=AuthSpec)
    launcher: Literal["local", "ssh", "ray"] = "local"
    ssh: SshDefaults = Field(default_factory=SshDefaults)
    ray: Optional[RaySpec] = Field(default=None, description="launcher 'ray': the Ray cluster (default: 'auto')")
    engine: Literal["nixl", "tcp"] = "nixl"
    topology: Optional[TopologySpec] = Field(
        default=None,
        description="datacenters, racks and nodes (required, except with launcher 'ray', whose nodes come from "
                    "Ray: there a node listed here by its Ray address overrides its name and place)",
    )
    roles: dict[str, RoleSpec] = Field(default_factory=dict)
    models: list[ModelSpec] = Field(default_factory=list)
    endpoints: EndpointsSpec = Field(default_factory=EndpointsSpec)

    # --- derived views (pure) -------------------------------------------------------

    def nodes(self) -> list["PlacedNode"]:
        if self.topology is None:  # a ray spec before its nodes are resolved (launch.ray_nodes)
            return []
        return [
            PlacedNode(dc=dc.name, rack=rack.name, spec=node)
            for dc in self.topology.datacenters
            for rack in dc.racks
            for node in rack.nodes
        ]

    def node(self, name: str) -> "PlacedNode":
        for placed in self.nodes():
            if placed.spec.name == name:
                return placed
        raise KeyError(name)

    def ssh_for(self, node: NodeSpec) -> SshDefaults:
        """Cluster ssh defaults with the node's own overrides applied."""
        if node.ssh is None:
            return self.ssh
        override = node.ssh.model_dump(exclude_none=True)
        return self.ssh.model_copy(update=override)

    def ray_or_default(self) -> RaySpec:
        return self.ray or RaySpec()

    def model(self, name: str) -> ModelSpec | None:
        return next((m for m in self.models if m.name == name), None)


class PlacedNode(BaseModel):
    """A node with its place in the topology tree."""

    model_config = ConfigDict(frozen=True)
    dc: str
    rack: str
    spec: NodeSpec

    @property
    def name(self) -> str:
        return self.spec.name
