"""The network-namespace testbed behind ``scripts/testbed`` (see ``main``)."""
