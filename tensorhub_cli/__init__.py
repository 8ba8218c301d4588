"""TensorHub: Reference-Oriented Storage for LLM weights in RL post-training.

``connect(...)`` (the endpoint library) is what trainers and rollout engines link; the
``th`` CLI drives clusters. See ``endpoint`` for the publish/fetch/unpublish protocol.
"""

__version__ = "0.1.0"

# Cheap: api.py imports the endpoint stack only when connect is called.
from .api import connect  # noqa: E402

__all__ = ["connect"]
