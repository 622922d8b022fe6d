"""Confined workers (issue 13): every worker tree in a cgroup of its own with the limits of its
spec (else torpord's [workers] defaults), a restored or woken instance in a new cgroup, never its
source's, and every cgroup gone with its tree. Real processes, real CRIU, real cgroups: cgroup v2
where the node has memory, cpu and pids there, else v1 (CI's hybrid layout)."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import FUNCTIONS, Torpord, cgroup_bases, cgroup_dirs, cgroup_tag

HOG = FUNCTIONS / "hog"
MIB = 1 << 20


@pytest.fixture(scope="module")
def confined(torpor_bin: Path, criu_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces, runs CRIU and makes cgroups")
    d = Torpord(torpor_bin, tmp_path_factory.mktemp("torpord-confine"), config="[workers]\npids_limit = 512\n")
    try:
        skip_unless_confining(d)
        yield d
    finally:
        d.stop()


UNCONFINED = "cannot confine workers in cgroups"


def skip_unless_confining(d: Torpord) -> None:
    """Skips on a node whose cgroups the daemon cannot use (it then serves unconfined, as
    `workers.allow_unconfined = true` lets it: e.g. the H100 machine's cgroup v2 group delegates
    no cpu or pids controller), naming the daemon's own reason."""
    for line in d.log_text().splitlines():
        if UNCONFINED in line:
            d.stop()
            pytest.skip(f"this node cannot confine workers: {line[line.index(UNCONFINED):][:300]}")


def hog_dir(tmp_path: Path, name: str, extra: str = "") -> Path:
    """The hog function under another name, with `extra` TOML (keys before any table)."""
    d = tmp_path / name
    d.mkdir()
    shutil.copy(HOG / "handler.py", d / "handler.py")
    (d / "torpor.toml").write_text(f'name = "{name}"\nentry = "handler:Hog"\ntimeout_s = 60\n{extra}')
    return d


def own_cgroups(answer: dict[str, Any], state: Path) -> list[Path]:
    """The directories of the torpor cgroups a hog's answer says it runs in (memory, cpu, pids)."""
    dirs = [d for d in cgroup_dirs(answer["cgroup"]) if cgroup_tag(state) in d.parts]
    assert dirs, f"the worker runs in none of the daemon's cgroups: {answer['cgroup']}"
    return dirs


def read(d: Path, name: str) -> str:
    return (d / name).read_text().strip()


def limits_of(dirs: list[Path]) -> dict[str, Any]:
    """memory (bytes or None), cpu (cores or None), pids (int or None) as the cgroup files say."""
    out: dict[str, Any] = {}
    for d in dirs:
        if (d / "memory.max").exists():  # v2: one directory
            m, (quota, period), p = read(d, "memory.max"), read(d, "cpu.max").split(), read(d, "pids.max")
            out = {
                "memory": None if m == "max" else int(m),
                "cpu": None if quota == "max" else int(quota) / int(period),
                "pids": None if p == "max" else int(p),
            }
        elif (d / "memory.limit_in_bytes").exists():
            m = int(read(d, "memory.limit_in_bytes"))
            out["memory"] = None if m >= 1 << 62 else m
        elif (d / "cpu.cfs_quota_us").exists():
            q = int(read(d, "cpu.cfs_quota_us"))
            out["cpu"] = None if q < 0 else q / int(read(d, "cpu.cfs_period_us"))
        elif (d / "pids.max").exists():
            p = read(d, "pids.max")
            out["pids"] = None if p == "max" else int(p)
    return out


def gone(dirs: list[Path], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(d.exists() for d in dirs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_an_instance_runs_in_a_cgroup_of_its_own_with_its_specs_limits(confined: Torpord) -> None:
    confined.deploy(HOG)
    r = confined.invoke("hog", {"mib": 8})
    assert r.status == 200, r.body
    assert r.start == "restored", r.headers
    [inst] = confined.instances("hog")
    dirs = own_cgroups(r.json(), confined.state)
    # Named after the instance, below the daemon's directory: memory, cpu and pids each.
    assert all(d.name.startswith(inst["id"] + ".") for d in dirs), (dirs, inst)
    assert {d.parent for d in dirs} == set(cgroup_bases(confined.state)), dirs
    # torpor.toml: memory_limit = "96MiB", cpu_limit = 0.5, pids_limit = 64.
    assert limits_of(dirs) == {"memory": 96 * MIB, "cpu": 0.5, "pids": 64}, dirs
    # Every process of the tree is in it; nothing else is.
    for d in dirs:
        procs = {int(p) for p in read(d, "cgroup.procs").split()}
        assert len(procs) == 2, (d, procs)  # the init and the worker
    # Stopped, the instance takes its cgroup with it.
    assert confined.request("POST", "/v1/functions/hog/stop").status == 200
    assert gone(dirs), f"{dirs} outlived the instance\n{confined.log_text()}"


def test_defaults_come_from_the_config_and_a_second_instance_gets_another_cgroup(
    confined: Torpord, tmp_path: Path
) -> None:
    confined.deploy(hog_dir(tmp_path, "hogdefault", "[scaling]\nmax_instances = 2\n"))
    first = confined.invoke("hogdefault", {})
    assert first.status == 200, first.body
    a = own_cgroups(first.json(), confined.state)
    # [workers] pids_limit = 512 in this daemon's config; memory_limit's default, 8 GiB; no CPU limit.
    assert limits_of(a) == {"memory": 8 << 30, "cpu": None, "pids": 512}, a
    # Two requests at once: two instances, two cgroups.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: confined.invoke("hogdefault", {"mib": 64, "sleep_s": 1.5}), range(2)))
    assert all(x.status == 200 for x in answers), [x.body for x in answers]
    seen = {tuple(own_cgroups(x.json(), confined.state)) for x in answers}
    assert len(confined.instances("hogdefault")) == 2 and len(seen) == 2, seen
    assert confined.request("POST", "/v1/functions/hogdefault/stop").status == 200
    assert gone([d for dirs in seen for d in dirs])


def test_a_woken_instance_lands_in_a_new_cgroup_not_its_sources(confined: Torpord, tmp_path: Path) -> None:
    fdir = hog_dir(
        tmp_path, "hogsleep", 'memory_limit = "128MiB"\n[keepalive]\ngpu_release_s = 1\nhibernate_s = 1\nevict_s = 600\n'
    )
    confined.deploy(fdir)
    r = confined.invoke("hogsleep", {"mib": 4})
    assert r.status == 200, r.body
    before = own_cgroups(r.json(), confined.state)
    deadline = time.monotonic() + 30
    while confined.instances("hogsleep")[0]["stage"] != "hibernated":
        assert time.monotonic() < deadline, confined.log_text()
        time.sleep(0.1)
    # Hibernated: no process, so no cgroup.
    assert gone(before), before
    r = confined.invoke("hogsleep", {"mib": 4})
    assert r.status == 200 and r.start == "restored", (r.status, r.body, r.headers)
    after = own_cgroups(r.json(), confined.state)
    assert set(after).isdisjoint(before), (before, after)
    assert limits_of(after)["memory"] == 128 * MIB
    assert confined.request("POST", "/v1/functions/hogsleep/stop").status == 200
    assert gone(after)


def test_a_spec_with_a_limit_out_of_range_is_refused_in_one_line(confined: Torpord, tmp_path: Path) -> None:
    fdir = hog_dir(tmp_path, "hogtiny", 'memory_limit = "16MiB"\n')
    r = confined.cli("deploy", fdir)
    assert r.returncode != 0
    line = 'memory_limit must be a size from 32 MiB to 1 TiB, got "16MiB"; write e.g. memory_limit = "2GiB"'
    assert line in r.stderr and r.stderr.count("\n") <= 2, r.stderr


@pytest.mark.parametrize(
    ("toml", "words"),
    [
        ("memory_limit = 1", "workers.memory_limit must be a number of bytes: 0 (no limit) or from 33554432"),
        ("cpu_limit = -2", "workers.cpu_limit must be a number of CPU cores: 0 (no limit) or from 0.01 to 1024"),
        ("pids_limit = 8", "workers.pids_limit must be an integer: 0 (no limit) or from 16 to 65536"),
        ('allow_unconfined = "yes"', "workers.allow_unconfined must be true or false"),
    ],
)
def test_a_config_limit_out_of_range_is_refused_in_one_line(
    torpor_bin: Path, tmp_path: Path, toml: str, words: str
) -> None:
    config = tmp_path / "torpord.toml"
    config.write_text(f"[workers]\n{toml}\n")
    r = subprocess.run(
        [torpor_bin, "serve", "--check", "--config", config], capture_output=True, text=True, timeout=30, check=False
    )
    assert r.returncode != 0 and words in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr


def test_without_a_cgroup_file_system_the_daemon_warns_or_refuses_when_told_to(
    torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    env = {"TORPORD_CGROUP_FS": str(tmp_path / "no-cgroup-fs")}
    state = tmp_path / "refused" / "state"
    strict = tmp_path / "strict.toml"
    strict.write_text("[workers]\nallow_unconfined = false\n")
    r = subprocess.run(
        [torpor_bin, "serve", "--config", strict, "--state-dir", state, "--socket", tmp_path / "refused.sock"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**os.environ, **env},
    )
    assert r.returncode != 0, r.stderr
    [line] = [x for x in r.stderr.splitlines() if "cannot confine workers in cgroups" in x]
    assert "workers.allow_unconfined = true" in line and "is not a cgroup2 mount" in line, line
    assert not (tmp_path / "refused.sock").exists()

    (tmp_path / "allowed").mkdir()
    # The built-in default: it starts, says so once, and runs its workers without limits.
    d = Torpord(torpor_bin, tmp_path / "allowed", env=env)
    try:
        # Logged just after the sockets are bound (the cgroup probe comes last; server.rs), so
        # it may follow the socket the fixture waited for by a moment.
        said = "(workers.allow_unconfined = true: workers run without limits; set it to false to refuse to start instead)"
        deadline = time.monotonic() + 10
        while said not in d.log_text():
            assert time.monotonic() < deadline, d.log_text()
            time.sleep(0.05)
        d.deploy(HOG)
        r2 = d.invoke("hog", {"mib": 1})
        assert r2.status == 200, r2.body
        assert not [x for x in cgroup_dirs(r2.json()["cgroup"]) if cgroup_tag(d.state) in x.parts]
    finally:
        d.stop()


def test_a_stopped_daemon_leaves_no_cgroup_behind(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    d = Torpord(torpor_bin, tmp_path)
    try:
        skip_unless_confining(d)
        d.deploy(HOG)
        assert d.invoke("hog", {}).status == 200
        bases = cgroup_bases(d.state)
        assert bases and any(any(b.iterdir()) for b in bases)
    finally:
        d.proc.terminate()
        d.proc.wait(timeout=30)
        left = cgroup_bases(d.state)
        d.stop()
    assert left == [], left


def test_a_function_past_its_memory_limit_is_killed_alone_and_its_request_answered_502(
    confined: Torpord, tmp_path: Path
) -> None:
    confined.deploy(HOG)
    bystander = hog_dir(tmp_path, "hogbystander")
    confined.deploy(bystander)
    assert confined.invoke("hogbystander", {"mib": 1}).status == 200
    [other] = confined.instances("hogbystander")
    ok = confined.invoke("hog", {"mib": 8})
    assert ok.status == 200, ok.body
    dirs = own_cgroups(ok.json(), confined.state)
    # 200 MiB in a 96 MiB cgroup: the kernel kills the worker.
    r = confined.invoke("hog", {"mib": 200})
    assert r.status == 502, (r.status, r.body)
    msg = r.body.decode()
    assert "killed by the kernel for using more than its memory limit, 96 MiB (memory_limit)" in msg, msg
    assert "raise memory_limit in the function's torpor.toml" in msg, msg
    assert "\n" not in msg.strip(), msg
    # Its cgroup went with it; the daemon, the other function's instance and the function live on.
    assert gone(dirs), dirs
    assert [(i["id"], i["pid"]) for i in confined.instances("hogbystander")] == [(other["id"], other["pid"])]
    assert confined.invoke("hogbystander", {"mib": 1}).status == 200
    again = confined.invoke("hog", {"mib": 8})
    assert again.status == 200 and again.start == "restored", (again.status, again.body)
    for name in ("hog", "hogbystander"):
        assert confined.request("POST", f"/v1/functions/{name}/stop").status == 200


def test_a_deploy_whose_setup_passes_the_memory_limit_fails_naming_it(confined: Torpord, tmp_path: Path) -> None:
    d = tmp_path / "hogsetup"
    d.mkdir()
    (d / "handler.py").write_text(
        "import torpor\n\n\n@torpor.function\nclass Big:\n    def setup(self):\n"
        "        self.b = bytearray(200 << 20)\n        for i in range(0, len(self.b), 4096):\n"
        "            self.b[i] = 1\n\n    def __call__(self, request):\n        return len(self.b)\n"
    )
    (d / "torpor.toml").write_text('name = "hogsetup"\nentry = "handler:Big"\nmemory_limit = "64MiB"\n')
    r = confined.cli("deploy", d)
    assert r.returncode != 0
    assert "deploy failed in load" in r.stderr, r.stderr
    assert "more than its memory limit, 64 MiB (memory_limit): raise memory_limit" in r.stderr, r.stderr
    # The daemon lives on and serves.
    assert confined.request("GET", "/v1/status").status == 200
