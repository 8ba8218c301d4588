"""One exception hierarchy: every error TensorHub raises on purpose is a
``TensorHubError``, importable from ``tensorhub_cli`` (cheaply) and from where each
lived before, keeping its old built-in base; ``connect`` names a bad argument."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

import tensorhub_cli
from tensorhub_cli import errors
from tensorhub_cli.hub import protocol as p

PUBLIC = ["TensorHubError", "BadArgument", "EndpointError", "FetchError", "LayoutError", "HubError",
          "VersionNotFound", "HubUnreachable", "TensorHubTimeout", "VersionTimeout"]


def test_every_public_error_is_exported_and_is_a_tensorhub_error():
    for name in PUBLIC:
        cls = getattr(tensorhub_cli, name)
        assert cls is getattr(errors, name) and name in tensorhub_cli.__all__
        assert issubclass(cls, tensorhub_cli.TensorHubError)


@pytest.mark.parametrize("name, bases", [
    ("BadArgument", (ValueError, errors.EndpointError)),
    ("EndpointError", (RuntimeError,)),
    ("FetchError", (RuntimeError,)),
    ("LayoutError", (ValueError,)),
    ("VersionNotFound", (errors.HubError,)),
    ("TensorHubTimeout", (TimeoutError,)),
    ("VersionTimeout", (errors.TensorHubTimeout, errors.VersionNotFound, TimeoutError)),
])
def test_each_keeps_the_builtin_base_older_code_catches(name, bases):
    assert issubclass(getattr(errors, name), bases)


def test_the_old_import_locations_name_the_same_classes():
    from tensorhub_cli.endpoint import EndpointError, FetchError, LayoutError
    from tensorhub_cli.endpoint.errors import EndpointError as E2
    from tensorhub_cli.endpoint.fetch import FetchError as F2
    from tensorhub_cli.hub.client import HubError, HubUnreachable
    from tensorhub_cli.layout import LayoutError as L2
    from tensorhub_cli.layout.tensors import LayoutError as L3

    assert EndpointError is E2 is errors.EndpointError and FetchError is F2 is errors.FetchError
    assert LayoutError is L2 is L3 is errors.LayoutError
    assert HubError is errors.HubError and HubUnreachable is errors.HubUnreachable


def test_importing_the_package_stays_cheap():
    code = ("import sys, tensorhub_cli; from tensorhub_cli import TensorHubError, FetchError, VersionTimeout; "
            "print(sorted(m for m in ('zmq', 'torch', 'msgspec', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_hub_errors_carry_the_code_and_survive_pickling():
    err = errors.VersionTimeout(p.Error(code="not_found", message="policy@latest did not become READY"))
    assert err.code == "not_found" and str(err) == "not_found: policy@latest did not become READY"
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is errors.VersionTimeout and back.code == "not_found" and str(back) == str(err)
    layout = errors.LayoutError("the destination does not match", ["w: shape (2,) != (3,)"])
    assert layout.problems == ["w: shape (2,) != (3,)"] and "w: shape" in str(layout)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(name="x"), "exactly one of hub"),
    (dict(hub="tcp://127.0.0.1:1", name="x"), "needs token"),
    (dict(hub="tcp://127.0.0.1:1", token="t", name=""), "name"),
    (dict(hub="tcp://127.0.0.1:1", token="t", name="x", tier="gpu"), "tier"),
    (dict(hub="tcp://127.0.0.1:1", token="t", name="x", engine="rdma"), "engine"),
    (dict(hub="tcp://127.0.0.1:1", token="t", name="x", heartbeat_s=-1), "heartbeat_s"),
    (dict(hub="tcp://127.0.0.1:1", token="t", name="x", connect_timeout=0), "connect_timeout"),
    (dict(hub="tcp://127.0.0.1:1", token="t", name="x", chunk_bytes=0.5), "chunk_bytes"),
    (dict(hub=7, token="t", name="x"), "hub"),
])
def test_connect_names_a_bad_argument_before_it_touches_the_network(kwargs, needle):
    with pytest.raises(errors.BadArgument) as exc:
        tensorhub_cli.connect(**kwargs)
    assert needle in str(exc.value) and "\n" not in str(exc.value)
