"""Pure planning: which holder serves which chunk to which reader.

- ``topology``: places, cost levels, the topology-group index helpers.
- ``rules``: DC crossing (seeds), spread chunks, full holders, chunks in flight.
- ``fairness``: fair shares of a source's read slots among the readers asking it.
- ``holders``: per DC, chunk → holders, so a plan walks only holders of what it needs.
- ``candidates``: the level-by-level walk that offers a plan its holders.
- ``choose``: the greedy assignment of chunks to candidates.

Nothing here touches sockets or the hub's classes: the hub passes its tables in.
"""

from .candidates import Limits, Reader, Sources, Walk
from .choose import Candidate, PlanResult, choose, first_bit
from .fairness import Asking, room
from .holders import HolderIndex
from .rules import copies, full_held, may_cross, serving_mask, spread, withheld
from .topology import LEVELS, REMOTE, Place, groups, join, leave, level_between

__all__ = ["LEVELS", "REMOTE", "Asking", "Candidate", "HolderIndex", "Limits", "Place", "PlanResult", "Reader",
           "Sources", "Walk", "choose", "copies", "first_bit", "full_held", "groups", "join", "leave", "level_between",
           "may_cross", "room", "serving_mask", "spread", "withheld"]
