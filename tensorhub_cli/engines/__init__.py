"""Byte movers (``base``: the interface; ``nixl``, ``tcp``), the peer channel (``wire``) and holder-side serving (``serve``)."""
