"""A vLLM engine with the ``"tensorhub"`` backend exits as promptly as one without it.

A user's script ends without ``shutdown_weight_transfer_engine`` (nothing says it
must): the interpreter exits with the engine, its workers and their endpoints still
up. Engines are started and ended (``vllm_driver exit``: start, init, take a
version, print ``done``, return from main), with the backend and without it; the time
from ``done`` to the process's exit is compared. With the hub gone first (a cluster
torn down before its jobs end), the exit must still be prompt: the endpoint cannot
have its unpublish acknowledged, and waiting for that helps no reader.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tensorhub_cli.launch.procs import stop_child

from ..conftest import free_port
from .test_adapter_vllm import ROOT
from .test_hub_service import TOKEN, start_hub
from .vllm_driver import make_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

EXIT_S = 10.0  # over the same engine without the backend


def run_once(model_dir, init: dict | None, kill_hub=None) -> float:
    """Seconds from ``done`` to the process's exit."""
    import json

    args = [sys.executable, "-m", "tests.integration.vllm_driver", "exit", "--dir", str(model_dir)]
    if init is not None:
        args += ["--init", json.dumps(init)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    try:
        for line in proc.stdout:
            log.append(line)
            if line.startswith("@th done"):
                break
        else:
            raise AssertionError("the engine ended before it was done:\n" + "".join(log[-40:]))
        if kill_hub is not None:
            kill_hub()
        done = time.monotonic()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the engine was still alive 120 s after its last call:\n{''.join(log[-20:])}") from None
        return time.monotonic() - done
    finally:
        stop_child(proc)


def test_an_engine_with_the_backend_exits_as_promptly_as_one_without_it(tmp_path):
    make_model(tmp_path / "A", seed=1)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    address = f"tcp://127.0.0.1:{free_port()}"
    hub, client = start_hub(token_file, address)

    trainer = subprocess.Popen([sys.executable, "-m", "tests.integration.vllm_driver", "trainer", "--dir",
                                str(tmp_path / "A"), "--hub", address, "--token-file", str(token_file),
                                "--version", "1"], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        assert trainer.stdout.readline().startswith("@th"), "the trainer did not start"
        init = {"hub": address, "token_file": str(token_file), "model": "policy", "engine": "tcp"}
        bare = run_once(tmp_path / "A", None)
        took = run_once(tmp_path / "A", {**init, "name": "exit0"})
        assert took <= bare + EXIT_S, f"the exit took {took:.1f} s with the backend, {bare:.1f} s without"

        def kill():
            client.close()
            stop_child(hub)

        gone = run_once(tmp_path / "A", {**init, "name": "exit-hub-gone"}, kill_hub=kill)
        assert gone <= bare + EXIT_S, f"with the hub gone the exit took {gone:.1f} s, {bare:.1f} s without the backend"
    finally:
        trainer.stdin.close()
        stop_child(trainer)
        client.close()
        stop_child(hub)
