"""The simulator's parameters: one validated YAML (``specs/sim.yaml`` documents the
defaults field by field).

Protocol: ``load(path)`` returns a ``SimParams`` or raises ``ParamsError`` whose lines
name each bad field (``cluster.nic_gbps: Input should be greater than 0``); ``None``
gives the defaults. Unknown keys are errors (``extra="forbid"``), so a typo never
silently falls back to a default. Everything a run depends on is here: a run is a
function of its parameters (and, with ``hub.charge_cpu``, of this machine's speed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..hub.mustering import MUSTER_S
from ..spec.model import require_beats

DEFAULT_FILE = Path(__file__).resolve().parents[2] / "specs" / "sim.yaml"


class ParamsError(ValueError):
    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Cluster(Strict):
    gpus: int = Field(1024, ge=2, le=65536, description="GPUs in all (trainer + rollouts)")
    gpus_per_node: int = Field(8, ge=1, le=64)
    nodes_per_rack: int = Field(16, ge=1, le=1024)
    nic_gbps: float = Field(200.0, gt=0, description="one NIC per GPU, each direction")
    nvlink_gbps: float = Field(3600.0, gt=0, description="GPU to GPU inside a node, per GPU and direction")
    rack_uplink_gbps: Optional[float] = Field(None, gt=0, description="each rack's uplink; null: non-blocking")
    wan_gbps: float = Field(400.0, gt=0, description="each DC's link to the WAN, each direction")
    link_efficiency: float = Field(0.95, gt=0, le=1, description="share of a link's rate a transfer achieves")


class Roles(Strict):
    trainer_fraction: float = Field(0.25, gt=0, lt=1, description="trainer GPUs / all GPUs")
    rollout_tp: int = Field(32, ge=1, le=4096, description="GPUs per rollout instance; each reads a 1/tp slice")
    export: Literal["every_rank", "gathered"] = Field(
        "every_rank", description="how the trainer publishes: every rank its own shard (ours, in place), or "
                                  "gathered: one rank per node sends its node's shards (as verl's engine gathers)")


class Model(Strict):
    params: float = Field(1.0e12, gt=0, description="parameters")
    dtype_bytes: int = Field(2, ge=1, le=8, description="bytes per parameter (bf16: 2)")
    chunk_mib: float = Field(1024.0, gt=0, description="chunk size, MiB")

    @property
    def nbytes(self) -> int:
        return int(self.params * self.dtype_bytes)

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mib * 2**20)


class Fetch(Strict):
    """A reader's loop (endpoint/fetch.py) and what its steps cost."""

    protocol: Literal["schedule", "window"] = Field(
        "schedule", description="schedule: one plan per reader, chains (hub/scheduling.py, sim/reader.py: what "
                                "endpoints run); window: a plan per window (endpoint/fetch.py, TH_FETCH=window)")
    window: int = Field(4, ge=1, le=1024, description="reads in flight per reader")
    report_s: float = Field(0.05, ge=0, description="results are reported at most this long after the first")
    plan_rtt_s: float = Field(0.0005, ge=0, description="a request's round trip on the wire, hub work excluded")
    verify_s: float = Field(0.0002, ge=0, description="per chunk, fixed part of the checksum")
    verify_gbps: float = Field(8000.0, gt=0, description="checksum rate, Gbit/s (device digest)")
    verifiers: int = Field(2, ge=1, le=64, description="checksums at once per endpoint")
    read_error_s: float = Field(0.5, ge=0, description="a read from a dead holder fails after this long")
    start_jitter_s: float = Field(0.1, ge=0, description="rollout instances start fetching within this spread")
    group_resolve: bool = Field(True, description="one resolve per rollout instance, its answer broadcast to the "
                                "instance's ranks in plan_rtt_s (Endpoint.resolve, as the vLLM adapter does); "
                                "False: every rank resolves, as in files measured before 2026-12-07")
    serial_heads: bool = Field(True, description="a chain head reads one chunk at a time (``Planned.serial``); "
                               "False: its whole window, as readers did in files measured before 2026-12-06")
    fragments: int = Field(4, ge=1, le=64, description="reads per chunk a child may wait for, each relayed as "
                           "it lands (endpoint/reader.py; TH_RELAY_FRAGMENTS); 1: whole chunks, as in every "
                           "measurement file without \"fragments\"")


class HubParams(Strict):
    expiry_s: float = Field(5.0, gt=0)
    heartbeat_s: float = Field(1.0, gt=0)
    sweep_s: float = Field(1.0, gt=0, description="how often the service expires and settles")
    max_reads_per_source: int = Field(4, ge=1, le=1024)
    charge_cpu: bool = Field(True, description="the real hub's measured CPU keeps the simulated hub core busy")
    cpu_scale: float = Field(1.0, gt=0, description="hub CPU here x this = hub CPU on the target machine")
    request_overhead_s: float = Field(3e-05, ge=0, description="per request: decode, encode, socket")
    own_process: bool = Field(True, description="with charge_cpu, the real hub runs in a process of its own, as "
                              "deployed, awake while it has requests queued (sim.hubhost, 'Warm and cold')")
    muster_s: float = Field(MUSTER_S, ge=0, le=10, description="a new swarm's first plans within this long are laid "
                            "out together, by rack and node (``hub.mustering``; the hub's --muster-s)")

    @model_validator(mode="after")
    def _beats(self) -> "HubParams":
        require_beats(self.expiry_s, self.heartbeat_s, "endpoint")
        return self


class Engine(Strict):
    quantum_frac: float = Field(0.02, ge=0, lt=1, description="rates wait this share of a chunk's time; 0: exact")
    quantum_s: float = Field(0.0, ge=0, description="and at least this long")
    limit_s: float = Field(3600.0, gt=0, description="simulated seconds before a scenario counts as stuck")


class Elastic(Strict):
    joiner_fraction: float = Field(0.25, gt=0, lt=1, description="share of the rollout GPUs that join at once")


class CrossDc(Strict):
    remote_fraction: float = Field(0.5, gt=0, lt=1, description="share of the rollout GPUs in the second DC")


class Workloads(Strict):
    elastic: Elastic = Elastic()
    cross_dc: CrossDc = CrossDc()


class Deltas(Strict):
    """A chunk of v+1 sent as what changed against v (tensorhub_cli/delta, docs/design.md,
    "Deltas"): a reader that holds chunk c of v and reads c of v+1 at one of ``levels``
    from a holder of both moves ``ratio`` x the chunk's bytes, then rebuilds it on one of
    its verifiers (the full chunk's bytes at ``rebuild_gbps``) before it counts. The hub
    still plans full chunks: only the bytes on the wire and the reader's time change.
    Defaults come from the trace (docs/measurements/delta-*-llama-2026-12-05.json)."""

    enabled: bool = Field(False, description="deltas in the workloads (th bench sim --deltas runs cross_dc both ways whatever this says)")
    # lr 1e-5, sparse + zstd 1, mean over the 40 versions: the dearer of the two traced
    # learning rates (1e-6 gave 0.014), so the model does not flatter deltas.
    ratio: float = Field(0.058, gt=0, le=1, description="delta bytes / chunk bytes")
    # The slowest rebuild the codec measured (sparse at lr 1e-5: 5,100-6,200 Mbit/s on one
    # core), rounded down: one CPU core per verifier, no GPU decode assumed.
    rebuild_gbps: float = Field(5.0, gt=0, description="rebuilt chunk bits per second, one verifier")
    levels: list[Literal["node", "rack", "dc", "remote"]] = Field(
        ["remote"], description="where deltas are sent: across DCs only, unless told")


class Curves(Strict):
    rollout_gpus: list[int] = Field([8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096], min_length=1)
    trainer_gpus: int = Field(256, ge=1, description="held fixed along the curve")

    @model_validator(mode="after")
    def _positive(self) -> "Curves":
        if any(n < 1 for n in self.rollout_gpus):
            raise ValueError("rollout_gpus must all be at least 1")
        return self


class Testbed(Strict):
    """Calibration: the namespace testbed of ``th bench fanout --testbed`` (8 nodes, one
    endpoint per node; link rates come from each measurement file)."""

    # Fitted (``calibrate.fit``, 2026-12-05, every stored file): the best point lies at the grid's
    # edge, so the reader loop costs more per chunk on the testbed than these terms name.
    fetch: Fetch = Fetch(protocol="window", plan_rtt_s=0.004, verify_s=0.008, verify_gbps=1.0, start_jitter_s=0.0)
    # The same terms for files measured with scheduled readers (``"protocol": "schedule"``),
    # fitted on those files alone (``calibrate.fit(..., which="schedule_fetch")``): a
    # scheduled reader pays no plan per window, so its fixed cost per chunk is its own.
    # Fitted 2026-12-05 on fanout-testbed-chunk4-schedule: the best point is the grid's
    # cheapest corner and still over-predicts N = 7 by 21 %: the chain's tail is
    # modelled dearer than the testbed shows (docs/design.md, "Schedules").
    schedule_fetch: Fetch = Fetch(protocol="schedule", plan_rtt_s=0.0005, verify_s=0.0005, verify_gbps=16.0,
                                  start_jitter_s=0.0)
    link_efficiency: float = Field(0.93, gt=0, le=1, description="one direction, when a file has no link check")
    duplex_efficiency: Optional[float] = Field(None, gt=0, le=1, description="both directions at once, as a "
                                               "share of twice the rate, when a file has no link check")
    request_overhead_s: float = Field(0.0003, ge=0)
    max_error: float = Field(0.15, gt=0, description="largest relative error the calibration accepts")


class SimParams(Strict):
    seed: int = 7
    cluster: Cluster = Cluster()
    roles: Roles = Roles()
    model: Model = Model()
    fetch: Fetch = Fetch()
    hub: HubParams = HubParams()
    engine: Engine = Engine()
    workloads: Workloads = Workloads()
    deltas: Deltas = Deltas()
    curves: Curves = Curves()
    testbed: Testbed = Testbed()


def load(path: Path | str | None = None) -> SimParams:
    """``path`` (a YAML mapping, every key optional), or the defaults."""
    if path is None:
        return SimParams()
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ParamsError([f"{path}: {exc}"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ParamsError([f"{path}: the top level must be a mapping of parameters"])
    try:
        return SimParams.model_validate(data)
    except ValidationError as exc:
        raise ParamsError([f"{path}: {'.'.join(str(x) for x in e['loc']) or '(top level)'}: {e['msg']}"
                           for e in exc.errors()]) from None
