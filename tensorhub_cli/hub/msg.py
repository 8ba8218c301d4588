"""The base of every message on the hub's wire: a msgspec Struct that refuses unknown
fields (a peer speaking another version fails loudly, never half-understood) and
leaves defaults off the wire."""

from __future__ import annotations

import msgspec


class Msg(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass
