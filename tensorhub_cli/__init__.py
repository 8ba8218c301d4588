"""TensorHub: Reference-Oriented Storage for LLM weights in RL post-training.

``connect(...)`` (the endpoint library) is what trainers and rollout engines link; the
``th`` CLI drives clusters. See ``endpoint`` for the publish/fetch/unpublish protocol
and ``errors`` for what every call may raise (all under ``TensorHubError``).
"""

__version__ = "0.1.0"

# Cheap: api.py imports the endpoint stack only when connect is called, and errors.py
# only the standard library.
from .api import connect  # noqa: E402
from .errors import (  # noqa: E402
    BadArgument,
    EndpointError,
    FetchError,
    HubError,
    HubUnreachable,
    LayoutError,
    TensorHubError,
    TensorHubTimeout,
    VersionNotFound,
    VersionTimeout,
)

__all__ = ["connect", "TensorHubError", "BadArgument", "EndpointError", "FetchError", "LayoutError", "HubError",
           "VersionNotFound", "HubUnreachable", "TensorHubTimeout", "VersionTimeout"]
