"""A flow-level simulator of TensorHub clusters, driven by the real hub and planner.

Every decision is the real one: a fresh ``hub.machine.Hub`` (the pure state machine,
its planner included) answers every ``Register``, ``Publish``, ``Resolve``, ``Plan``
(with progress) and ``Heartbeat`` of the simulated endpoints, with the simulated time
as its ``now``; only the bytes are simulated, as flows of a max-min fair network.
Nothing here opens a socket, starts a thread or sleeps; the wall clock is read only to
report how long a run took and to time the real hub's CPU. The one process started is
the hub's own, where ``hub.own_process`` asks for it (``hubhost``), over two pipes.

Modules, one concept each:

==============  =====================================================================
events          the discrete-event loop (simulated time, ordered callbacks)
network         links, flows, max-min fair rates (progressive filling), rate quantum
topology        GPUs on nodes in racks in DCs: NICs, NVLink, rack uplinks, WAN
hubserver       the real ``Hub`` on one simulated core: FIFO, beats and sweeps ahead, CPU charged
hubhost         where that ``Hub`` runs: in this process, or in one of its own
endpoint        a simulated endpoint and the reader loop of ``endpoint/fetch.py``
reader          a scheduled reader: the real ``endpoint.reader.Reader`` core on simulated events
world           one cluster: the above together; joins, failures (``kill``)
scenario        phases: register, publish a version, fetch it
workloads       standalone, elastic, cross-DC, each ours and its baseline
curves          time and hub CPU per version against the number of readers
calibrate       the same model at testbed size against stored measurements
alone           a run's hub calls replayed afterwards in a process holding only the hub
params          the validated YAML (``specs/sim.yaml``)
plot            the curves as a PNG
==============  =====================================================================

Where the simulation is coarse, on purpose: chunks are the unit (1 GiB by default at
cluster scale, so a 2 TB version is 2,048 chunks and a 1,024-GPU run stays within
minutes; ``th bench sim --chunk-mib`` sets another, and a chain's lag is a chunk a hop); a transfer is a flow with no latency of its own (the plan round trip and the
checksum are separate costs); rates are recomputed at most every ``quantum_frac`` of a
chunk's transfer time; memory registration, process start and the engine's own CPU are
not modelled, except in calibration, where the testbed's one host is a link every
transfer crosses, at the rate its measured CPU per byte allows (``calibrate.host_rate``).
"""
