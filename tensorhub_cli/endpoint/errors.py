"""The endpoint's own errors: a call it refuses, or a state it cannot reach in time.

``EndpointError`` means nothing changed that the message does not name; its subclass
``BadArgument`` names the argument at fault. ``FetchError`` (``fetch``) and
``LayoutError`` (``layout``) are the other two a caller sees. All are defined in
``tensorhub_cli.errors`` (the one hierarchy under ``TensorHubError``) and importable
from here as before.
"""

from __future__ import annotations

from ..errors import BadArgument, EndpointError

__all__ = ["BadArgument", "EndpointError"]
