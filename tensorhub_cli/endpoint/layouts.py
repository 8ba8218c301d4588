"""Which layout path a publish or fetch takes (contract 9), for the endpoint.

Protocol. ``published(state_dict, shard)`` turns DTensors into the ``Part``s a rank
registers in place (``layout.dtensor.parts``: replicated pieces published once) and
fills in ``shard`` from their mesh when the caller gave none (plain tensors: (0, 1)).
``place(shards, into)`` picks the reader's path: whole tensors of a version published
as whole tensors, or tensors keyed and shaped as the publishers' own pieces
(``layout.placement.piece_keys``: an agent's copy), take ``layout.place`` (chunks
land as they are); anything else (a
DTensor or ``Target`` destination, or a version published in boxes) is planned by box
overlap (``layout.overlap``), its values made ``Target``s by ``targets(into)`` (a
tensor is ``whole``, a DTensor its local box: ``layout.dtensor.target``).
``registered(d)`` lists the tensors whose memory a publish or fetch registers.
"""

from __future__ import annotations

import sys

from ..errors import LayoutError
from ..hub import protocol as p
from ..layout import dtensor
from ..layout import place as place_whole
from ..layout.overlap import place_boxes
from ..layout.placement import piece_keys
from ..layout.targets import Part, Target, whole


def _is_dtensor(value) -> bool:
    # Nothing is a DTensor until torch.distributed.tensor is imported, so ask only then:
    # importing it to ask cost a testbed reader's first fetch about 4 CPU-s (py-spy).
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(value, cls)


def published(state_dict: dict, shard) -> tuple[dict, tuple[int, int]]:
    if any(_is_dtensor(v) for v in state_dict.values()):
        state_dict, mesh_shard = dtensor.parts(state_dict)
        if shard is None:
            shard = mesh_shard
    return state_dict, (0, 1) if shard is None else shard


def registered(d: dict) -> list:
    out = []
    for v in d.values():
        if isinstance(v, (Part, Target)):
            out.append(v.tensor)
        elif _is_dtensor(v):
            out.append(v.to_local())
        else:
            out.append(v)
    return out


def place(shards: list[p.Manifest], into: dict):
    boxed = any(t.global_shape for m in shards for t in m.tensors)
    plain = all(not isinstance(v, (Part, Target)) and not _is_dtensor(v) for v in into.values())
    if plain and (not boxed or into.keys() == set(piece_keys(shards).values())):
        return place_whole(shards, into)  # the publishers' own layout (an agent's copy): chunks as they are
    return place_boxes(shards, targets(into))


def targets(into: dict) -> list[Target]:
    """A fetch destination as targets: a tensor is ``whole``, a DTensor its local box
    (``dtensor.target``), a ``Target`` itself. Every bad key is named at once."""
    import torch

    out, problems = [], []
    for key, value in into.items():
        try:
            if isinstance(value, Target):
                out.append(value)
            elif _is_dtensor(value):  # before Tensor: a DTensor is one
                out.append(dtensor.target(key, value))
            elif isinstance(value, torch.Tensor):
                out.append(whole(key, value))
            else:
                problems.append(f"{key}: a {type(value).__name__}, not a tensor, DTensor or Target")
        except LayoutError as e:
            problems += e.problems
    if problems:
        raise LayoutError("the destination cannot be laid out", problems)
    return out
