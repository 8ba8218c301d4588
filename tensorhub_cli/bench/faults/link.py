"""``link_down`` on the network-namespace testbed (root only): a source's link is cut mid-read.

Three testbed nodes on shaped links: the hub and the reader on n1, the publisher on
n2, a complete second holder on n3. When the hub shows the reader holding half the
bytes, ``ip link set eth0 down`` runs inside the namespace of the holder that served
most of the unfaulted fetch (as ``kill_source`` picks its victim): that node neither
serves nor heartbeats any more, and a read from it gets no reset, only silence. The
hub must expire it and tell the reader (``replan``), and the fetch must complete from
the other holder with the published bytes, well before the reader's own read timeout
(the endpoint's default, 30 s) could have re-planned anything: the row holds only if
recovery_s is under half of it. recovery_s = (completion − cut) − T₀·(1 − f), as for
``kill_source``; slowdown = the fetch against the same fetch without the cut, same
processes.
"""

from __future__ import annotations

import subprocess
import time

from ...hub import protocol as p
from ..rig import Driven, HubProcess, RigError
from ..testbed import Site, testbed
from .rows import EXPIRY_S, MID_FETCH, Run, fetch_row, row

READ_TIMEOUT_S = 30.0  # the reader's own give-up (the default): masking must not wait for it


def _link(state: dict, node: str, updown: str) -> None:
    ns = next(n["ns"] for n in state["nodes"] if n["name"] == node)
    subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "eth0", updown], check=True, timeout=10,
                   capture_output=True)


def link_down(mib: float, engine: str, timeout: float, window: int, serve_bps: int) -> dict:
    with testbed(3) as state:
        site = Site(state)
        with HubProcess(expiry_s=EXPIRY_S, host=site.address("n1"), prefix=site.prefix("n1")) as hub:
            r = Run(hub, mib, window, timeout)
            args = ["--hub", hub.address, "--token", hub.token, "--engine", engine]
            slow = {"TH_TEST_SERVE_BPS": str(serve_bps)}

            def spawn(name: str, node: str, env: dict | None, *more: str) -> Driven:
                return Driven(name, ["-m", "tensorhub_cli.bench.faults", "--name", name, *args, *site.place(node),
                                     *more], env=env, prefix=site.prefix(node))

            procs = [spawn("source-n2", "n2", slow), spawn("holder-n3", "n3", slow),
                     spawn("reader-n1", "n1", None, "--read-timeout-s", str(READ_TIMEOUT_S))]
            source, holder, reader = procs
            try:
                for d in procs:
                    d.hello  # noqa: B018 (all started in parallel; wait for each)
                r.publish(source, "ld", 1)
                done = r.fetch(holder, "ld", 1, window=16)
                if done.get("error") or done["lost_bytes"]:
                    raise RigError(f"link_down setup: {holder.name} fetch: {done}")
                base = r.unfaulted("link_down", reader, "ld", 1)
                # cut the link of the holder that served most of the unfaulted fetch
                cut, victim = ("n2", source) if base["stats"]["from_publishers"] * 2 > r.nbytes else ("n3", holder)
                r.send_fetch(reader, "ld", 1)
                held = r.wait_held("ld", 1, reader, MID_FETCH)
                f = min(held / r.nbytes, 1.0)
                t_cut = time.monotonic()
                _link(state, cut, "down")
                res = reader.recv(r.timeout + 30)
                if res.get("error"):
                    return row("link_down", False, 0, None, None, f"fetch failed after {cut}'s link went down: "
                                                                  f"{res['error']}")
                expired = r.wait(lambda: victim.name not in [e.name for e in r.client.call(
                    p.Status(), timeout=5).endpoints], f"the hub to expire {victim.name}", timeout=10 * EXPIRY_S)
                recovery = (res["t_done"] - t_cut) - base["s"] * (1 - f)
                landed = f < 1.0
                extra = (f"{cut}'s link ({victim.name}) cut at {f:.0%} of the read (read timeout {READ_TIMEOUT_S}s, "
                         f"hub expiry {EXPIRY_S}s); {victim.name} expired: {bool(expired)}; testbed links "
                         f"{state['rates_mbit']['node']:.0f} Mbit/s"
                         if landed else "the fetch finished before the cut landed (no mid-read fault)")
                masked = recovery < READ_TIMEOUT_S / 2
                if landed and not masked:
                    extra += f"; re-planned only at the read timeout ({recovery:.1f}s), not at the hub's expiry"
                return fetch_row("link_down", res, base["s"], recovery, extra,
                                 need=landed and bool(expired) and masked)
            finally:
                r.client.close()
                for d in procs:
                    if d.proc.poll() is None:
                        d.kill()  # n2 cannot deregister; nothing to drain either
                    d.stop()
