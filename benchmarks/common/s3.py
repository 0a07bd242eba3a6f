"""The local S3-compatible server the object-storage benchmarks run against: moto's, in a
subprocess on ``127.0.0.1`` (traffic never leaves the machine), and the environment that points
botocore (s3fs) at it in this process and every one it starts."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

SERVER_START_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def s3_environment(endpoint: str) -> dict[str, str]:
    """What points botocore (s3fs) at ``endpoint``, in this process and every one it starts."""
    no_proxy = ",".join(p for p in (os.environ.get("NO_PROXY"), "127.0.0.1") if p)
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",  # never look for instance credentials off the machine
        "NO_PROXY": no_proxy,  # a proxy configured for the outside must not see the local server
        "no_proxy": no_proxy,
    }


def _answers(endpoint: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(endpoint + "/", timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP reply means it is serving
    except OSError:
        return False


@contextlib.contextmanager
def s3_server(log_path: str, timeout: float = SERVER_START_TIMEOUT_S) -> Iterator[str]:
    """moto's S3 server on ``127.0.0.1`` (a free port) until the block ends; yields its endpoint.

    Its output goes to ``log_path``, whose end is quoted when it does not come up in ``timeout``.
    """
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + timeout
        while not _answers(endpoint):
            if server.poll() is not None or time.monotonic() > deadline:
                with open(log_path, "rb") as f:
                    tail = f.read()[-2000:].decode(errors="replace")
                state = f"exited with code {server.returncode}" if server.returncode is not None else f"no answer in {timeout:.0f} s"
                raise RuntimeError(f"the moto S3 server on {endpoint} did not come up ({state}); its output:\n{tail}")
            time.sleep(0.1)
        yield endpoint
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
