"""The real OpenAI-compatible server the evals tests talk to: `transformers serve` on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest


def send_json(handler, payload, code: int = 200) -> None:
    """Answer an HTTP request with ``payload`` as JSON (the scripted OpenAI-compatible endpoints)."""
    data = json.dumps(payload).encode()
    handler.send_response(code)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc=None, seconds: float = 90, log: Path | None = None) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:] if log else proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {seconds} s")


@pytest.fixture(scope="session")
def served(glm_ckpt, tmp_path_factory):
    """`transformers serve` on 127.0.0.1 serving the tiny GLM-5-layout model, started and stopped here.
    Its log goes to a file: an unread pipe would fill up and stall the server after enough requests."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(["transformers", "serve", str(glm_ckpt), "--host", "127.0.0.1", "--port", str(port),
                                 "--device", "cpu"], stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, log=log)
        yield f"http://127.0.0.1:{port}/v1/completions"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
