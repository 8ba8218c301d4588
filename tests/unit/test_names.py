"""Model names: one pattern for the hub, the endpoint and `th`; `th publish` and `th
unpublish` refuse a bad one before contacting anything; an undeclared model is
published with the documented defaults, and `th publish` says so."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tensorhub_cli.cli import app
from tensorhub_cli.errors import BadArgument
from tensorhub_cli.names import MODEL_PATTERN, check_model, valid_model

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.mark.parametrize("name", ["policy", "p", "Qwen2.5-7B_instruct", "v1.2", "0day", "x" * 64])
def test_plain_names_pass(name):
    assert valid_model(name) and check_model(name) == name


@pytest.mark.parametrize("name", ["", "my policy", "org/model", "-lead", ".hidden", "_x", "x" * 65, "a\n",
                                  "pólicy", "a:b", 7, None])
def test_other_names_are_refused_naming_the_argument_and_the_pattern(name):
    assert not valid_model(name)
    with pytest.raises(BadArgument) as exc:
        check_model(name, what="MODEL")
    assert isinstance(exc.value, ValueError)
    assert str(exc.value).startswith(f"MODEL {name!r} is not a valid model name") and MODEL_PATTERN in str(exc.value)


def test_the_pattern_is_the_specs_name_rule():
    """A model the spec declares always passes: both rules accept the same names."""
    from pydantic import TypeAdapter, ValidationError

    from tensorhub_cli.spec.model import Name

    spec_name = TypeAdapter(Name)
    for name in ["policy", "a.b-c_d", "x" * 64, "x" * 65, "-a", "a b", "", "a/b"]:
        try:
            spec_name.validate_python(name)
            ok = True
        except ValidationError:
            ok = False
        assert ok == valid_model(name), name


@pytest.mark.parametrize("argv", [
    ["publish", "my policy", "--from", "x.safetensors"],
    ["unpublish", "org/model", "3"],
])
def test_publish_and_unpublish_refuse_a_bad_name_before_anything_else(th_home, argv):
    # No cluster runs under th_home: a check made later would say so instead.
    result = runner.invoke(app, argv)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and f"MODEL {argv[1]!r} is not a valid model name" in lines[0], result.output


def test_unpublish_refuses_a_version_below_one(th_home):
    result = runner.invoke(app, ["unpublish", "policy", "0"])
    assert result.exit_code == 2 and "VERSION" in result.output


def test_an_undeclared_model_gets_the_documented_defaults_and_a_notice():
    from tensorhub_cli.launch.models import publish_settings
    from tensorhub_cli.spec import load

    spec = load(REPO / "specs" / "local.yaml")  # declares policy with chunk_mb 1
    assert publish_settings(spec, "policy") == (1 << 20, None)
    chunk, notice = publish_settings(spec, "polcy")
    assert chunk == 16 << 20
    assert "model 'polcy' is not declared in cluster 'demo'" in notice and "(models: policy)" in notice
    assert "16 MiB chunks, retention keep_latest 2, min_reliable_copies 1" in notice
