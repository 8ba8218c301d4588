"""The hub process's defaults that its configuration layers share (``hub.__main__``'s
flags, the cluster spec, the simulator's params). No imports: the spec loads this on
every `th` command, and the hub's modules would cost it tens of milliseconds."""

# ``--muster-s``: readers that start together ask within tens of milliseconds of each
# other (the testbed's seven did); the first waits this long for its answer
# (``hub.mustering``).
MUSTER_S = 0.05
