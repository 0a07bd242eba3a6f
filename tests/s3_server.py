"""A real S3-compatible server (moto's) on 127.0.0.1 for the object-storage tests, with injectable
faults: latency, and HTTP errors for requests that match a predicate.

The server runs on a thread of the test process and is reached over HTTP by every process of the
test (``AWS_ENDPOINT_URL`` in the environment, so Lightning's own fsspec and the writer process
find it too). Only the loopback address is used.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class Faults:
    """What the server does to requests for which ``match(method, path, query)`` is true: wait
    ``delay`` seconds, and answer ``status`` to the next ``fail`` of them (``fail=-1``: all)."""

    match: Callable[[str, str, str], bool] = lambda method, path, query: False
    delay: float = 0.0
    fail: int = 0
    status: int = 503
    code: str = "SlowDown"  # S3's error code for throttling (503)
    after: bool = False  # fail after the server carried the request out (a lost reply)
    failed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def clear(self) -> None:
        with self.lock:
            self.match, self.delay, self.fail, self.failed = (lambda *_: False), 0.0, 0, 0
            self.status, self.code, self.after = 503, "SlowDown", False

    def decide(self, method: str, path: str, query: str) -> tuple[float, bool]:
        with self.lock:
            if not self.match(method, path, query):
                return 0.0, False
            failing = self.fail == -1 or self.failed < self.fail
            if failing:
                self.failed += 1
            return self.delay, failing


@dataclass(frozen=True)
class Request:
    """A request the server received: ``length`` bytes of body; ``copy_source`` for a copy made
    on the server (CopyObject, UploadPartCopy)."""

    method: str
    path: str
    length: int
    copy_source: str | None


class S3Server:
    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
        self.faults = Faults()
        self.requests: list[Request] = []  # every request received, in order (appends are atomic)
        app = DomainDispatcherApplication(create_backend_app)

        def with_faults(environ: dict[str, Any], start_response: Any) -> Any:
            self.requests.append(Request(
                environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), int(environ.get("CONTENT_LENGTH") or 0),
                environ.get("HTTP_X_AMZ_COPY_SOURCE"),
            ))  # fmt: skip
            delay, failing = self.faults.decide(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("QUERY_STRING", ""))
            if delay:
                time.sleep(delay)
            if failing:
                if self.faults.after:
                    for _ in app(environ, lambda *args, **kwargs: None):
                        pass
                else:
                    environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
                body = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{self.faults.code}</Code><Message>injected</Message></Error>".encode()
                start_response(f"{self.faults.status} Injected", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
                return [body]
            return app(environ, start_response)

        self._server = make_server("127.0.0.1", 0, with_faults, threaded=True, request_handler=MotoRequestHandler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-server", daemon=True)
        self._thread.start()

    def environment(self) -> dict[str, str]:
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": self.endpoint}, skip_instance_cache=True)

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()


def start_or_skip() -> S3Server:
    import pytest

    try:
        import moto  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as err:
        pytest.skip(f"the S3 tests need moto[server] and s3fs (pip install -e '.[test]'): {err}")
    try:
        return S3Server()
    except OSError as err:
        pytest.skip(f"could not start the S3 server on 127.0.0.1: {err}")


def set_environment(monkeypatch: Any, server: S3Server) -> None:
    for key, value in server.environment().items():
        monkeypatch.setenv(key, value)
    os.environ.pop("AWS_PROFILE", None)
