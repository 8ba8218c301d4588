"""TensorHub: Reference-Oriented Storage for LLM weights in RL post-training.

The Python API (``connect``) lands with the data-plane issue; until then this package
provides the ``th`` CLI, the cluster spec, the hub and the agents.
"""

__version__ = "0.1.0"
