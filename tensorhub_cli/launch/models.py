"""How `th publish` treats a model the cluster spec's ``models:`` does not declare.

Protocol. A declared model is published with its ``chunk_mb``. An undeclared one is
published too, with the defaults a ``models:`` entry would get (``ModelSpec``'s:
16 MiB chunks; retention ``keep_latest`` 2, ``min_reliable_copies`` 1, which is also
what the hub applies to a model it has no policy for), and the command says so in one
line naming the declared models: the cluster runs the spec it was started with (`th up`
refuses a changed one), so refusing would leave no way to publish a new model short of
a restart, while a typo is seen at once and undone with `th unpublish MODEL VERSION`.
"""

from __future__ import annotations

from typing import Optional

from ..spec.model import ClusterSpec, ModelSpec


def publish_settings(spec: ClusterSpec, model: str) -> tuple[int, Optional[str]]:
    """``(chunk_bytes, notice)``: ``notice`` is None for a declared model, else the line
    to show the operator."""
    declared = spec.model(model)
    if declared is not None:
        return int(declared.chunk_mb * 2**20), None
    default = ModelSpec(name="default")  # (the entry every field of which is left to its default)
    declared_names = ", ".join(m.name for m in spec.models) or "none"
    notice = (f"model {model!r} is not declared in cluster {spec.name!r}'s spec (models: {declared_names}); "
              f"publishing it with the defaults: {default.chunk_mb:g} MiB chunks, retention keep_latest "
              f"{default.retain.keep_latest}, min_reliable_copies {default.retain.min_reliable_copies}")
    return int(default.chunk_mb * 2**20), notice
