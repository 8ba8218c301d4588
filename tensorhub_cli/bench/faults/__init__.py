"""`th bench faults`: inject one fault per row into real processes on loopback and check
that the contract it threatens held.

Protocol. One hub (``rig.HubProcess``: it can be killed -9 and started again on the
same address and token) and seven endpoint processes (``rig.Driven``, running this
package: ``bench.peer``'s ops plus ``corrupt``, ``peer_address``, a ``fetch`` that
zeroes its destination first and counts lost bytes, an ``unpublish`` that can overwrite
what it unpublished). Each fault uses its own model, so
rows do not share replicas. Payload: ``mib`` MiB in 4 int32 tensors built from the
version number (every process can rebuild the published bytes), cut into 64 chunks.
Holders that must be slow enough to fault mid-read serve at a throttled rate
(``TH_TEST_SERVE_BPS``, per connection) chosen so that an unfaulted fetch takes about
``TARGET_S`` seconds; that hook only acts on tcp serving, so with ``--engine nixl`` a
fetch is fast and a mid-read fault may land late (the row says where it landed).

Each row: ``fault``, ``ok`` (the contract held), ``lost_bytes`` (bytes of the reader's
destination that differ from the published tensors after the fetch returned, counted
against the rebuilt tensors byte by byte: 0 is the only acceptable value),
``recovery_s``, ``slowdown`` (the faulted operation's time ÷ the same operation without
the fault, both measured in this run, by the same processes) and ``detail``.

Faults (in this order):

- ``kill_source``: a publisher and a complete second holder; a reader fetches with a
  small window; when the hub shows the reader holding half the bytes, the holder that
  served most of the reader's unfaulted fetch is killed -9. The fetch must complete
  from the other holder. recovery_s = (completion − kill) − T₀·(1 − f), with T₀ the
  unfaulted fetch time and f the fraction held at the kill: the time beyond what the
  rest of an unfaulted fetch would have taken (about 0 on loopback, where the throttle
  is per connection: the survivor serves the whole window as fast as both did; it can
  be slightly negative, timing noise).
- ``kill_reader``: a reader is killed -9 mid-read; its source's ``unpublish`` (issued
  right after the kill) must still complete within ``timeout`` once the hub expires
  the reader and drops its pins. recovery_s = unpublish's return − kill; slowdown =
  that unpublish's time ÷ an unpublish with no read in flight. lost_bytes is 0 by
  construction (no reader accepted bytes).
- ``corrupt_chunk``: the only holder flips one byte of every chunk it serves (after
  its checksums were taken); once the hub counted the reader's failed read, a clean
  holder of the same version appears. The reader must detect the corruption (its
  ``corrupt`` count ≥ 1), re-read elsewhere and end with the published bytes.
  recovery_s = completion − the clean holder's publish.
- ``kill_hub``: the hub is killed -9 when the reader holds half the bytes, and started
  again on the same address and token. recovery_s = until the registry is rebuilt (the
  version READY again, listing the publisher and the reader as holders); the fetch must
  complete with the published bytes.
- ``kill_agent`` (``processes``): the node agent holding the last retained copy of a
  version is killed -9 and started again with the same arguments, as ``th up``
  restarts it; it re-adopts the copy that survived in its store (``agent.store``),
  verified chunk by chunk, and the version is READY and fetched again. recovery_s =
  kill until READY again.
- ``slow_heartbeat`` (``processes``): the source is SIGSTOPped mid-read for at least two
  heartbeats, below the hub's expiry; nothing may be dropped (no expiry, still a
  holder, its later unpublish a normal one). recovery_s = SIGCONT until the hub heard
  from it again.
- ``zombie_read`` (``data``): a read outlives its read timeout; its source unpublishes
  and overwrites its tensors the moment that returns, while the fetch goes on from a
  second holder into the same memory. recovery_s = how long that unpublish waited.
  With ``--engine nixl`` it is skipped (``skipped`` says so): nothing throttles NIXL
  serving here, so no read can be made to outlive its timeout.
- ``nixl_giveup`` (``data``): a NIXL read given up while its holder is stalled (its
  progress held up ``NIXL_STALL_S``: that holder runs without NIXL's progress thread,
  ``engines.nixl_progress``; reader's read timeout ``NIXL_TIMEOUT_S``); the
  holder unpublishes and overwrites its tensors, then resumes. A given-up GET is not
  stopped by releasing it (NIXL issue #1958): the engine disconnects the holder and
  counts the read over only once NIXL reports it final, its chunk fenced and its
  source pinned until then; lost_bytes also counts what landed after the holder
  resumed. Its three processes always run the nixl engine; where NIXL does not load
  it is skipped (``skipped`` says so).
- ``link_down`` (``link``, testbed only: root and network namespaces): ``ip link set
  down`` on the link of a source mid-read; the hub expires it and tells the reader,
  which re-plans its reads from it long before its own read timeout; the fetch
  completes from the other holder.
- ``bad_token``: from the fetch's start until it returns, requests with a wrong token
  go, one at a time, alternately to the hub and to the holder's peer channel; each
  must be refused (``auth``), the hub's ``errors.auth`` counter must grow by exactly
  the hub's share, at least one of each must be answered while the fetch ran, and the
  fetch must end with the published bytes.
- ``garbage_frames``: the same with undecodable frames (hub: ``errors.malformed``;
  holder: a ``Refused`` ``malformed`` answer).

For the last two recovery_s is 0 (nothing is lost to recover).

Files: ``peer`` (the endpoint process), ``rows`` (the run's client and the row),
``processes``, ``data``, ``hostile``, ``link``: the faults by what they break.
"""

from __future__ import annotations

from ..rig import Driven, HubProcess, RigError
from ..testbed import unavailable as testbed_unavailable
from .data import corrupt_chunk, nixl_giveup, zombie_read
from .hostile import rows as hostile
from .link import link_down
from .processes import kill_agent, kill_hub, kill_reader, kill_source, slow_heartbeat
from .rows import CHUNKS, EXPIRY_S, Run

FAULTS = ["kill_source", "kill_reader", "corrupt_chunk", "kill_hub", "kill_agent", "slow_heartbeat", "zombie_read",
          "nixl_giveup", "bad_token", "garbage_frames"]
TESTBED_FAULTS = ["link_down"]  # root and network namespaces (``bench.testbed``)
TARGET_S = 2.0  # an unfaulted throttled fetch takes about this long
ZOMBIE_READ_S = 3.0  # zombie_read: one chunk read from its slow source takes this long
ZOMBIE_TIMEOUT_S = 1.0  # ... and its reader's read timeout is this
NIXL_STALL_S = 1.5  # nixl_giveup: the holder serves nothing this long (below the hub's expiry) ...
NIXL_TIMEOUT_S = 0.4  # ... while its reader gives reads up after this


def run(mib: float = 64, engine: str = "tcp", timeout: float = 120, window: int = 2,
        faults: list[str] | None = None) -> dict:
    """Every fault of ``faults`` (default: ``FAULTS``, then ``TESTBED_FAULTS`` where
    ``bench.testbed`` can build a testbed; ``skipped`` says why not)."""
    why_not = testbed_unavailable()
    faults = faults or FAULTS + ([] if why_not else TESTBED_FAULTS)
    nbytes = int(mib * 2**20) // 16 * 16
    slow = {"TH_TEST_SERVE_BPS": str(max(1, int(nbytes / (window * TARGET_S))))}
    slower = {"TH_TEST_SERVE_BPS": str(max(1, int(nbytes / CHUNKS / ZOMBIE_READ_S)))}
    rows: list[dict] = []
    skipped = {f: why_not for f in TESTBED_FAULTS if f not in faults and why_not}  # fault -> why it did not run
    with HubProcess(expiry_s=EXPIRY_S) as hub:
        r = Run(hub, mib, window, timeout)
        args = ["--hub", hub.address, "--token", hub.token, "--engine", engine]

        def spawn(name: str, env: dict | None = None, *more: str) -> Driven:
            return Driven(name, ["-m", "tensorhub_cli.bench.faults", "--name", name, *args, *more], env=env)

        def spawn_nixl(name: str, *more: str, env: dict | None = None) -> Driven:  # (the later --engine wins)
            return spawn(name, env, "--engine", "nixl", *more)

        procs: dict[str, Driven] = {}
        try:
            for name, env in [("pubA", slow), ("holderB", slow), ("reader", None), ("victim", None),
                              ("reader2", None), ("slowZ", slower)]:
                procs[name] = spawn(name, env)
            procs["readerZ"] = spawn("readerZ", None, "--read-timeout-s", str(ZOMBIE_TIMEOUT_S))
            if "nixl_giveup" in faults:
                # (the stalled holder progresses UCX from its service thread, so holding its
                # engine's lock stalls it; NIXL's own progress thread would serve on)
                procs["stallG"] = spawn_nixl("stallG", env={"TH_NIXL_PROGRESS_THREAD": "0"})
                procs["holderG"] = spawn_nixl("holderG")
                procs["readerG"] = spawn_nixl("readerG", "--read-timeout-s", str(NIXL_TIMEOUT_S))
            engines = {d.hello["engine"] for d in procs.values()}  # all start in parallel; wait for each
            survivor = procs["pubA"]
            if "kill_source" in faults:
                row, survivor = kill_source(r, procs)
                rows.append(row)
            if "kill_reader" in faults:
                rows.append(kill_reader(r, survivor, procs["victim"]))
            if "corrupt_chunk" in faults:
                rows.append(corrupt_chunk(r, survivor, procs["reader"], procs["reader2"]))
            if "kill_hub" in faults:
                rows.append(kill_hub(r, survivor, procs["reader2"]))
            if "kill_agent" in faults:
                rows.append(kill_agent(r, survivor, procs["reader2"], engine))
            if "slow_heartbeat" in faults:
                rows.append(slow_heartbeat(r, survivor, procs["reader2"]))
            if "zombie_read" in faults and engine == "nixl":
                skipped["zombie_read"] = ("nothing throttles nixl serving here, so no read outlives its timeout; "
                                          "run it with --engine tcp")
            elif "zombie_read" in faults:
                rows.append(zombie_read(r, procs["slowZ"], procs["reader2"], procs["readerZ"]))
            if "nixl_giveup" in faults:
                nixl = {procs[n].hello["engine"] for n in ("stallG", "holderG", "readerG")} == {"nixl"}
                if nixl:
                    rows.append(nixl_giveup(r, procs["stallG"], procs["holderG"], procs["readerG"], NIXL_STALL_S))
                else:
                    skipped["nixl_giveup"] = "NIXL did not load here (its processes fell back to tcp)"
            wanted = [f for f in ("bad_token", "garbage_frames") if f in faults]
            if wanted:
                rows += hostile(r, survivor, procs["reader2"], wanted)
            if "link_down" in faults:
                if why_not:
                    raise RigError(f"link_down: {why_not}")
                rows.append(link_down(mib, engine, timeout, window, int(slow["TH_TEST_SERVE_BPS"])))
        finally:
            r.client.close()
            for d in procs.values():
                if d.proc.poll() is None:
                    d.kill()  # nothing to drain: the run is over (and a clean close can wait on a dead hub)
                d.stop()
    return {"workload": "faults", "bytes": nbytes, "engine": ",".join(sorted(engines)), "window": window,
            "throttle_bps": int(slow["TH_TEST_SERVE_BPS"]), "rows": rows, "ok": all(row["ok"] for row in rows),
            "skipped": skipped}
