"""Cluster spec: YAML → validated ``ClusterSpec`` (see ``load``)."""

from .checks import resolve_path, select_nodes
from .load import SpecError, load, schema
from .model import ClusterSpec, NodeSpec, PlacedNode

__all__ = ["ClusterSpec", "NodeSpec", "PlacedNode", "SpecError", "load", "resolve_path", "schema", "select_nodes"]
