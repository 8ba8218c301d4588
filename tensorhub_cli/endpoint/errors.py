"""The endpoint's own error: a call it refuses, or a state it cannot reach in time.

``EndpointError`` means nothing changed that the message does not name; ``FetchError``
(``fetch``) and ``LayoutError`` (``layout``) are the other two a caller sees.
"""

from __future__ import annotations


class EndpointError(RuntimeError):
    pass
