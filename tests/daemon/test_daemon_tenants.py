"""Tenants (issue 13, item 3; docs/security.md, "Tenants") through the real daemon, real workers
and real CRIU: each TCP token of `tenant_tokens_file` sees and acts on its tenant's functions
only (another tenant's answer 404, as if they did not exist), a deploy whose spec names another
tenant is refused 403, the admin token (`token_file`) and the Unix socket see every tenant, and
functions of two tenants with the same weights never share a read-only copy (one tenant's
still do). The tests run in file order and share one daemon.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import FUNCTIONS, Torpord

ADMIN = "admin-token-0123456789abcdef"
TOKENS = {"team-a": "team-a-token-0123456789abcdef", "team-b": "team-b-token-0123456789abcdef"}
SPLITBUF = FUNCTIONS / "splitbuf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def private_file(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def tenants(torpor_bin: Path, criu_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    root = tmp_path_factory.mktemp("torpord-tenants")
    admin = private_file(root / "token", ADMIN + "\n")
    lines = "".join(f"{t} = {k}\n" for t, k in TOKENS.items())
    tokens = private_file(root / "tenant-tokens", f"# one line per tenant\n{lines}")
    port = free_port()
    config = f'tcp = "127.0.0.1:{port}"\ntoken_file = "{admin}"\ntenant_tokens_file = "{tokens}"\n'
    d = Torpord(torpor_bin, root, config=config)
    d.port = port  # type: ignore[attr-defined]
    try:
        yield d
    finally:
        d.stop()


def tcp(d: Torpord, token: str, method: str, path: str, body: Any = None, timeout: float = 180) -> tuple[int, Any]:
    """A request on the TCP listener with `token`: (status, the JSON body, or NDJSON lines)."""
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=timeout)  # type: ignore[attr-defined]
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        try:
            conn.request(method, path, body=data, headers=headers)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered from the head alone (a refusal) before the body landed: read it
        r = conn.getresponse()
        text = r.read().decode()
        if r.getheader("content-type", "").startswith("application/x-ndjson"):
            return r.status, [json.loads(x) for x in text.splitlines() if x.strip()]
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text
    finally:
        conn.close()


def function_dir(root: Path, name: str, tenant: str | None) -> Path:
    d = root / name
    shutil.copytree(FUNCTIONS / "echoer", d)
    toml = d / "torpor.toml"
    text = toml.read_text().replace('name = "echoer"', f'name = "{name}"')
    if tenant is not None:
        text = text.replace(f'name = "{name}"\n', f'name = "{name}"\ntenant = "{tenant}"\n')
    toml.write_text(text)
    return d


def names(listing: Any) -> set[str]:
    return {f["name"] for f in listing["functions"]}


def test_a_tenant_deploys_lists_and_invokes_its_own(tenants: Torpord, tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("fns")
    tenants.fns = root  # type: ignore[attr-defined]
    # Three functions on one interpreter and preload set, of three tenants (a spec without a
    # tenant is the default tenant's; the admin deploys it): each boots a base of its own.
    for name, tenant, token in [("fa", "team-a", TOKENS["team-a"]), ("fb", "team-b", TOKENS["team-b"]), ("fd", None, ADMIN)]:
        status, lines = tcp(tenants, token, "POST", "/v1/functions", {"dir": str(function_dir(root, name, tenant))})
        assert status == 200 and "result" in lines[-1], (status, lines, tenants.log_text())
        assert lines[-1]["result"]["base_reused"] is False, lines
        assert "boot_base" in [x.get("phase") for x in lines], lines
    status, listing = tcp(tenants, TOKENS["team-a"], "GET", "/v1/functions")
    assert status == 200 and names(listing) == {"fa"}, listing
    status, answer = tcp(tenants, TOKENS["team-a"], "POST", "/v1/functions/fa/invoke", {"say": "hi"})
    assert status == 200, (status, answer)
    status, detail = tcp(tenants, TOKENS["team-a"], "GET", "/v1/functions/fa")
    assert status == 200 and detail["spec"]["tenant"] == "team-a", detail
    status, logs = tcp(tenants, TOKENS["team-a"], "GET", "/v1/functions/fa/logs")
    assert status == 200 and logs["files"], logs
    status, st = tcp(tenants, TOKENS["team-a"], "GET", "/v1/status")
    assert status == 200 and st["functions"] == 1, st


def test_another_tenants_functions_answer_404_as_if_they_did_not_exist(tenants: Torpord) -> None:
    b = TOKENS["team-b"]
    status, listing = tcp(tenants, b, "GET", "/v1/functions")
    assert status == 200 and names(listing) == {"fb"}, listing
    calls: list[tuple[str, str, Any]] = [
        ("GET", "", None),
        ("POST", "/invoke", {"say": "hi"}),
        ("POST", "/stop", {}),
        ("GET", "/logs", None),
        ("DELETE", "", None),
    ]
    for method, suffix, body in calls:
        got = tcp(tenants, b, method, f"/v1/functions/fa{suffix}", body)
        missing = tcp(tenants, b, method, f"/v1/functions/nosuch{suffix}", body)
        assert got[0] == 404, (method, suffix, got)
        # The same answer as for a function that does not exist: nothing shows it does.
        assert got[1]["error"] == missing[1]["error"].replace("nosuch", "fa"), (got, missing)
    # Untouched: still deployed, still team-a's, still answering.
    status, answer = tcp(tenants, TOKENS["team-a"], "POST", "/v1/functions/fa/invoke", {"say": "still here"})
    assert status == 200, (status, answer)
    # The metrics name every tenant's functions: the admin's only.
    status, body = tcp(tenants, b, "GET", "/metrics")
    assert status == 403 and "admin token" in body["error"] and "\n" not in body["error"], (status, body)


def test_a_deploy_for_another_tenant_is_refused_403_and_a_taken_name_409(tenants: Torpord) -> None:
    root: Path = tenants.fns  # type: ignore[attr-defined]
    b = TOKENS["team-b"]
    status, body = tcp(tenants, b, "POST", "/v1/functions", {"dir": str(root / "fa")})
    assert status == 403, (status, body)
    assert body["error"].startswith('the spec names tenant "team-a", and this token is tenant "team-b"'), body
    assert "\n" not in body["error"], body
    # The default tenant is a tenant like the others.
    status, body = tcp(tenants, b, "POST", "/v1/functions", {"dir": str(root / "fd")})
    assert status == 403 and '"default"' in body["error"], (status, body)
    # team-b's own spec, but the name is team-a's: refused, team-a's function untouched.
    shadow = function_dir(root / "shadow", "fa", "team-b")
    status, body = tcp(tenants, b, "POST", "/v1/functions", {"dir": str(shadow)})
    assert status == 409 and "taken on this node by another tenant" in body["error"], (status, body)
    status, detail = tcp(tenants, ADMIN, "GET", "/v1/functions/fa")
    assert status == 200 and detail["spec"]["tenant"] == "team-a", detail


def test_the_admin_token_and_the_unix_socket_see_every_tenant(tenants: Torpord) -> None:
    status, listing = tcp(tenants, ADMIN, "GET", "/v1/functions")
    assert status == 200 and names(listing) >= {"fa", "fb", "fd"}, listing
    status, answer = tcp(tenants, ADMIN, "POST", "/v1/functions/fb/invoke", {"say": "admin"})
    assert status == 200, (status, answer)
    status, _ = tcp(tenants, ADMIN, "GET", "/metrics")
    assert status == 200
    r = tenants.cli("ls", "--json")
    assert r.returncode == 0, r.stderr
    assert {"fa", "fb", "fd"} <= {f["name"] for f in json.loads(r.stdout)["functions"]}, r.stdout
    # A tenant stops and deletes its own.
    status, body = tcp(tenants, TOKENS["team-b"], "POST", "/v1/functions/fb/stop", {})
    assert status == 200 and body["function"] == "fb", body
    status, body = tcp(tenants, TOKENS["team-b"], "DELETE", "/v1/functions/fb")
    assert status == 200 and body["deleted"] == "fb", body
    # A token that is no one's: 401.
    status, body = tcp(tenants, "team-c-token-0123456789abcdef", "GET", "/v1/functions")
    assert status == 401, (status, body)


def splitbuf_twin(root: Path, name: str, tenant: str) -> Path:
    d = root / name
    shutil.copytree(SPLITBUF, d)
    toml = d / "torpor.toml"
    toml.write_text(toml.read_text().replace('name = "splitbuf"\n', f'name = "{name}"\ntenant = "{tenant}"\n'))
    return d


def test_two_tenants_with_the_same_weights_never_share_a_copy(tenants: Torpord, tmp_path: Path) -> None:
    maps: dict[str, dict[str, Any]] = {}
    stored: dict[str, int] = {}
    for name, tenant in [("sb-a1", "team-a"), ("sb-a2", "team-a"), ("sb-b", "team-b")]:
        lines = tenants.deploy(splitbuf_twin(tmp_path, name, tenant))
        (snap,) = [x for x in lines if x.get("phase") == "snapshot_function"]
        assert snap["split"] is True and snap["readonly_segments"] == 2, snap
        stored[name] = snap["stored_bytes"]
        status, info = tcp(tenants, TOKENS[tenant], "POST", f"/v1/functions/{name}/invoke", {"op": "info"})
        assert status == 200, (status, info, tenants.log_text())
        maps[name] = info["maps"]
    a1, a2, b = maps["sb-a1"], maps["sb-a2"], maps["sb-b"]
    for seg in ["weights", "table"]:
        assert "memfd:torpor-segment" in a1[seg]["path"] and a1[seg]["perms"] == "r--s", a1[seg]
        # One tenant's two functions: one physical copy of the same contents.
        assert a1[seg]["inode"] == a2[seg]["inode"], (seg, a1, a2)
        # Another tenant's: a copy of its own.
        assert a1[seg]["inode"] != b[seg]["inode"], (seg, a1, b)
    # The chunk store deduplicates within a tenant only: team-a's second deploy of the same
    # contents stores less than its first, and team-b's, the same contents again, stores what
    # team-a's first did, so its deploy's `stored_bytes` cannot tell it what team-a holds.
    assert 0 < stored["sb-a2"] < stored["sb-a1"], stored
    assert stored["sb-b"] == stored["sb-a1"], stored
    for tenant in ("team-a", "team-b"):
        assert (tenants.state / "chunks-tenants" / tenant).is_dir(), tenant


def start_failure(torpor_bin: Path, root: Path, tokens_text: str, mode: int = 0o600) -> str:
    """Starts a daemon whose tenant tokens file holds `tokens_text`: its last stderr line."""
    root.mkdir()
    tokens = root / "tenant-tokens"
    tokens.write_text(tokens_text)
    tokens.chmod(mode)
    config = root / "torpord.toml"
    config.write_text(f'tcp = "127.0.0.1:{free_port()}"\ntenant_tokens_file = "{tokens}"\n')
    r = subprocess.run(
        [torpor_bin, "serve", "--config", config, "--state-dir", root / "state", "--socket", root / "s.sock"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "TORPOR_SOCKET"},
    )
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert not (root / "s.sock").exists(), "a refused start must not leave its socket"
    return r.stderr.strip().splitlines()[-1]


def test_a_bad_tenant_tokens_file_is_refused_in_one_line(torpor_bin: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord takes its state directory as root")
    line = start_failure(torpor_bin, tmp_path / "a", "team-a = team-a-token-0123456789\nTeam B = x\n")
    assert "tenant tokens file" in line and "line 2" in line and "not a tenant name" in line, line
    line = start_failure(torpor_bin, tmp_path / "b", "team-a = short\n")
    assert "line 1" in line and "at least 16" in line and "short" not in line, line
    line = start_failure(torpor_bin, tmp_path / "c", "team-a = team-a-token-0123456789\n", mode=0o644)
    assert "readable by group or others" in line and "chmod 600" in line, line
    line = start_failure(torpor_bin, tmp_path / "d", "t = same-token-0123456789abc\nu = same-token-0123456789abc\n")
    assert "repeats the token of line 1" in line and "same-token" not in line, line
