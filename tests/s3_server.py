"""A real S3 server for tests: moto's ThreadedMotoServer on 127.0.0.1 and a free port, nothing else.

``s3_server`` (session) starts it once; ``s3_url`` gives each test a fresh bucket. Clients reach it through
the real S3 HTTP protocol (s3fs/botocore over a socket), never an in-process mock.
"""

from __future__ import annotations

import logging
import socket
import uuid

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    @property
    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint, "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
                "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                "client_kwargs": {"region_name": CREDENTIALS["AWS_DEFAULT_REGION"]}}

    @property
    def env(self) -> dict:
        """The standard environment a process needs to reach this server (no storage_options)."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def new_bucket(self) -> str:
        import s3fs

        name = f"b-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options).call_s3("create_bucket", Bucket=name)
        return name

    def stop(self) -> None:
        self._server.stop()


@pytest.fixture(scope="session")
def s3_server():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3_url(s3_server) -> str:
    """``s3://<fresh bucket>/run`` on the test server (pass ``s3_server.storage_options`` with it)."""
    return f"s3://{s3_server.new_bucket()}/run"
