"""The cluster token file is replaced whole, never truncated in place, and a process
refuses a missing or empty one at start, naming the file.

The failure this guards: `th up` writes a node's token once per process it starts
there, and a hub that opened the file while the agent's write had truncated it read
an empty token, then refused every endpoint as "bad cluster token". A reader that
opened the file before a rewrite must still read the old token, whole (rename), not
the empty or new content a truncate would show it."""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest

from tensorhub_cli.errors import BadArgument
from tensorhub_cli.tokens import read_token_file, token_shell, write_token_file


def test_a_rewrite_never_shows_an_open_reader_a_truncated_file(tmp_path):
    path = write_token_file(tmp_path / "n1" / "token", "old-token")
    with open(path, encoding="utf-8") as before:
        write_token_file(path, "new-token")
        assert before.read() == "old-token"  # in place, this read "" or "new-token"
    assert read_token_file(path) == "new-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["token"]  # no temporary left


def test_the_remote_shell_line_replaces_the_file_by_rename_too(tmp_path):
    d = tmp_path / "node"
    line = token_shell(str(d))
    assert subprocess.run(["bash", "-c", line], input="old-token", text=True, timeout=10).returncode == 0
    with open(d / "token", encoding="utf-8") as before:
        assert subprocess.run(["bash", "-c", line], input="new-token", text=True, timeout=10).returncode == 0
        assert before.read() == "old-token"
    assert read_token_file(d / "token") == "new-token"
    assert stat.S_IMODE((d / "token").stat().st_mode) == 0o600
    assert [p.name for p in d.iterdir()] == ["token"]


@pytest.mark.parametrize("content", ["", "  \n"])
def test_an_empty_token_file_is_refused_naming_it(tmp_path, content):
    path = tmp_path / "token"
    path.write_text(content)
    with pytest.raises(BadArgument, match=f"--token-file {path}: the file is empty"):
        read_token_file(path)


def test_a_missing_token_file_is_refused_naming_it(tmp_path):
    with pytest.raises(BadArgument, match=f"--token-file {tmp_path / 'none'}: cannot read"):
        read_token_file(tmp_path / "none")


@pytest.mark.parametrize("module", ["tensorhub_cli.hub", "tensorhub_cli.agent"])
def test_hub_and_agent_exit_2_on_an_empty_token_naming_the_file(tmp_path, module):
    path = tmp_path / "token"
    path.write_text("\n")
    args = (["--bind", "tcp://127.0.0.1:1"] if module.endswith("hub")
            else ["--hub", "tcp://127.0.0.1:1", "--node", "n1", "--address", "127.0.0.1"])
    done = subprocess.run([sys.executable, "-m", module, *args, "--token-file", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"--token-file {path}: the file is empty" in done.stderr
