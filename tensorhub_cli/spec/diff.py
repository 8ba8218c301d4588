"""Which fields differ between two cluster specs (what `th up` on a running cluster
names when the spec given is not the one the cluster runs)."""

from __future__ import annotations

from typing import Any

from .model import ClusterSpec


def changed_fields(running: ClusterSpec, given: ClusterSpec) -> list[str]:
    """Dotted paths of every field whose value differs, in document order. Lists of
    named items (datacenters, racks, nodes, models) are matched by name:
    ``topology.datacenters[dc1].racks[rack1].nodes[node2].address``; an item only
    one side has is ``…nodes[node4] (added)`` / ``(removed)``."""
    out: list[str] = []
    _diff(running.model_dump(mode="json"), given.model_dump(mode="json"), "", out)
    return out


def _named(items: list) -> dict[str, Any] | None:
    if not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return None
    names = [i["name"] for i in items]
    return dict(zip(names, items)) if len(set(names)) == len(names) else None


def _diff(a: Any, b: Any, path: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        _diff_keyed(a, b, lambda key: f"{path}.{key}" if path else str(key), out)
        return
    if isinstance(a, list) and isinstance(b, list):
        na, nb = _named(a), _named(b)
        if na is not None and nb is not None and (na or nb):
            _diff_keyed(na, nb, lambda name: f"{path}[{name}]", out)
            return
        if len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                _diff(x, y, f"{path}[{i}]", out)
            return
    if a != b:
        out.append(path or "(the whole spec)")


def _diff_keyed(a: dict, b: dict, sub, out: list[str]) -> None:
    """Entries of two mappings, by key: added, removed, or compared (``sub``: key → path)."""
    for key in list(a) + [k for k in b if k not in a]:
        if key not in a:
            out.append(f"{sub(key)} (added)")
        elif key not in b:
            out.append(f"{sub(key)} (removed)")
        else:
            _diff(a[key], b[key], sub(key), out)
