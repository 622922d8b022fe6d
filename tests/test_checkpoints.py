"""Periodic checkpoints of a long-running job (`torpor run --checkpoint-every SECS --keep N
--checkpoints DIR`, crates/torpor-snapshot/src/checkpoints.rs, docs/checkpoints.md): a real
numpy training loop is checkpointed while it trains, killed with SIGKILL, and `torpor restore DIR`
resumes it from the newest checkpoint: every loss it prints afterwards equals, bit for bit, the
loss of an uninterrupted run at that step. Each checkpoint stores only the chunks that changed;
older ones are pruned to N."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import PROGRAMS, PYTHON, ROOT, Arg, Torpor, Workers, parse_pid, wait_until

TRAIN = PROGRAMS / "train_numpy.py"
WORKLOAD = ROOT / "bench" / "checkpoint" / "workload.py"
STEPS = 400
# The GPU job: its checkpoints (driver checkpoint of the CUDA context, a GB-sized image) take
# seconds, so it trains longer (~1 min at 50 ms a step) to be killed after three of them.
GPU_STEPS = 1200
LINE = re.compile(
    r"torpor: checkpoint (ckpt-\d+): job stopped ([\d.]+) s; .* \((\d+) chunks\), .* new to the store \((\d+) chunks\)"
)


def reference() -> list[str]:
    import sys

    sys.path.insert(0, str(PROGRAMS))
    import train_numpy

    return [repr(x) for x in train_numpy.curve(STEPS, 0.0, None)]


def steps(log: Path) -> list[tuple[int, str]]:
    out = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0] == "step" and parts[2] == "loss":
            out.append((int(parts[1]), parts[3]))
    return out


def test_a_killed_training_job_resumes_from_its_newest_checkpoint(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    argv: list[Arg] = [PYTHON, TRAIN, "--steps", STEPS, "--sleep", "0.05"]
    killed_job_resumes(torpor, workers, tmp_path, argv, reference(), every=1.0)


def torch_cuda() -> bool:
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([PYTHON, "-c", probe], capture_output=True, timeout=120).returncode == 0


@pytest.mark.skipif(not torch_cuda(), reason="needs PyTorch with a CUDA GPU (the GPU machine)")
def test_a_killed_pytorch_training_job_on_the_gpu_resumes_bit_for_bit(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    """A small transformer (bench/checkpoint/workload.py) trained on the GPU: checkpointed with its
    GPU state (the driver's checkpoint) while it trains, killed, restored from the newest."""
    ref_run = subprocess.run(
        [PYTHON, WORKLOAD, "--kind", "torch", "--steps", str(GPU_STEPS)], capture_output=True, text=True, timeout=300
    )
    assert ref_run.returncode == 0, ref_run.stderr
    ref_log = tmp_path / "reference.log"
    ref_log.write_text(ref_run.stdout)
    ref = [loss for _, loss in steps(ref_log)]
    assert len(ref) == GPU_STEPS
    argv: list[Arg] = [PYTHON, WORKLOAD, "--kind", "torch", "--steps", GPU_STEPS, "--sleep", "0.05"]
    killed_job_resumes(torpor, workers, tmp_path, argv, ref, every=3.0, total=GPU_STEPS)


def killed_job_resumes(
    torpor: Torpor, workers: Workers, tmp_path: Path, argv: list[Arg], ref: list[str], every: float, total: int = STEPS
) -> None:
    """Checkpoint ARGV every EVERY s, kill it after three, restore the newest: the curve goes on as REF."""
    ckpts, log, log2 = tmp_path / "ckpts", tmp_path / "train.log", tmp_path / "resumed.log"
    p, out, err = workers.popen_torpor(
        "run", "--log", log, "--checkpoint-every", str(every), "--keep", "2", "--checkpoints", ckpts, "--", *argv
    )
    wait_until(lambda: out.read_text().strip().isdigit() or p.poll() is not None, 30, "torpor run to print the pid")
    init = int(out.read_text().strip())
    workers.track(init)

    def taken() -> list[re.Match[str]]:
        return [m for m in map(LINE.search, err.read_text().splitlines()) if m]

    # Three checkpoints of a job that is training: a PyTorch job spends its first seconds in
    # imports and CUDA's start-up, which checkpoints of no step would cover (seen on the H100).
    wait_until(lambda: steps(log) != [] or p.poll() is not None, 180, "the job's first step")
    first = len(taken())
    wait_until(lambda: len(taken()) >= first + 3 or p.poll() is not None, 180, "three checkpoints")
    assert len(taken()) >= first + 3, err.read_text()
    os.kill(init, signal.SIGKILL)
    assert p.wait(timeout=30) == 128 + signal.SIGKILL, err.read_text()
    assert f"pid {init} exited with status 137" in err.read_text()
    before = steps(log)
    assert before and before[-1][0] < total, "the job finished before it was killed: make it longer"
    assert all(loss == ref[s - 1] for s, loss in before), "the job's own curve differs from the reference"

    # Only the chunks that changed are stored: after the first, each checkpoint reuses most.
    ms = taken()
    for m in ms[1:]:
        chunks, new = int(m.group(3)), int(m.group(4))
        assert new < chunks, f"checkpoint {m.group(1)} stored all {chunks} chunks again"
    # Pruned to the newest two.
    refs = sorted(f.name for f in (ckpts / "store" / "refs").iterdir())
    assert refs == [f"{m.group(1)}.json" for m in ms[-2:]], (refs, err.read_text())
    # inspect lists them, with what each shares with the other.
    shown = torpor.ok("inspect", ckpts).stdout
    assert all(m.group(1) in shown for m in ms[-2:]) and ms[0].group(1) not in shown, shown
    used = json.loads(torpor.ok("inspect", ckpts, "--json").stdout)
    assert [u["snapshot"] for u in used] == [m.group(1) for m in ms[-2:]]
    assert all(u["exclusive"] < u["stored"] and u["shared_with"] for u in used), used

    r = torpor.ok("restore", ckpts, "--detach", "--log", log2)
    workers.track(parse_pid(r))
    assert f"restoring checkpoint {ms[-1].group(1)}" in r.stderr, r.stderr
    wait_until(lambda: log2.exists() and "done" in log2.read_text(), 180, "the resumed job to finish")
    after = steps(log2)
    first = after[0][0]
    # It resumed (not restarted) at a step the killed job had reached, and went on to the end.
    assert 1 < first <= before[-1][0] + 1, (first, before[-1])
    assert [s for s, _ in after] == list(range(first, total + 1))
    diff = [(s, loss, ref[s - 1]) for s, loss in after if loss != ref[s - 1]]
    assert not diff, f"the resumed loss curve differs from the uninterrupted one: {diff[:3]}"
    # The materialised copy is gone once the restore is done.
    assert not [c for c in ckpts.iterdir() if c.name.startswith(".restore-")]


def test_a_restored_job_is_checkpointed_on_and_survives_a_second_kill(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    """`torpor restore DIR --checkpoint-every`: the restored job goes on being checkpointed into
    DIR (the numbering goes on), so a second kill loses only what came after the newest one."""
    ref = reference()
    ckpts, log = tmp_path / "ckpts", tmp_path / "train.log"
    every = ["--checkpoint-every", "1", "--keep", "2"]
    p, out, err = workers.popen_torpor(
        "run", "--log", log, *every, "--checkpoints", ckpts, "--", PYTHON, TRAIN, "--steps", STEPS, "--sleep", "0.05"
    )
    wait_until(lambda: out.read_text().strip().isdigit() or p.poll() is not None, 30, "torpor run to print the pid")
    init = int(out.read_text().strip())
    workers.track(init)
    wait_until(lambda: len(LINE.findall(err.read_text())) >= 2 or p.poll() is not None, 90, "two checkpoints")
    os.kill(init, signal.SIGKILL)
    assert p.wait(timeout=30) == 137, err.read_text()
    first = [m.group(1) for m in map(LINE.search, err.read_text().splitlines()) if m]

    log2 = tmp_path / "resumed.log"
    p2, _, err2 = workers.popen_torpor("restore", ckpts, *every, "--log", log2)
    started = re.compile(r"torpor: checkpointing pid (\d+) every")
    wait_until(lambda: started.search(err2.read_text()) is not None or p2.poll() is not None, 60, "the restore")
    m = started.search(err2.read_text())
    assert m, err2.read_text()
    restored = int(m.group(1))
    workers.track(restored)
    assert f"restoring checkpoint {first[-1]}" in err2.read_text()
    wait_until(lambda: len(LINE.findall(err2.read_text())) >= 2 or p2.poll() is not None, 90, "two more checkpoints")
    second = [m.group(1) for m in map(LINE.search, err2.read_text().splitlines()) if m]
    # The numbering goes on after the newest checkpoint of the first run.
    assert int(second[0].split("-")[1]) == int(first[-1].split("-")[1]) + 1, (first, second)
    os.kill(restored, signal.SIGKILL)
    assert p2.wait(timeout=30) == 137, err2.read_text()
    resumed = steps(log2)

    log3 = tmp_path / "resumed-again.log"
    r = torpor.ok("restore", ckpts, "--detach", "--log", log3)
    workers.track(parse_pid(r))
    newest = sorted(f.name for f in (ckpts / "store" / "refs").iterdir())
    assert newest == [f"{c}.json" for c in second[-2:]], newest
    wait_until(lambda: log3.exists() and "done" in log3.read_text(), 90, "the job to finish")
    after = steps(log3)
    # Resumed from the second run's newest checkpoint: past where the second run started.
    assert resumed[0][0] < after[0][0] <= resumed[-1][0] + 1, (resumed[0], after[0], resumed[-1])
    assert [s for s, _ in after] == list(range(after[0][0], STEPS + 1))
    assert all(loss == ref[s - 1] for s, loss in resumed + after), "a resumed curve differs from the uninterrupted one"

    # The older of the two kept is there too, by name: it resumes earlier, on the same curve.
    log4 = tmp_path / "older.log"
    old = parse_pid(torpor.ok("restore", ckpts, "--checkpoint", second[-2], "--detach", "--log", log4))
    workers.track(old)
    wait_until(lambda: log4.exists() and len(steps(log4)) >= 3, 60, "the older checkpoint to train")
    older = steps(log4)
    assert resumed[0][0] <= older[0][0] < after[0][0], (resumed[0], older[0], after[0])
    assert all(loss == ref[s - 1] for s, loss in older)
    os.kill(old, signal.SIGKILL)


def test_a_failing_checkpoint_leaves_the_job_training_and_the_directory_clean(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    """Every checkpoint fails after CRIU's dump (TORPOR_FAULT=after-dump): each is reported on one
    line, the job trains on to the end unchanged, nothing is committed, nothing half-written stays."""
    ckpts, log = tmp_path / "ckpts", tmp_path / "train.log"
    r = torpor(
        "run", "--log", log, "--checkpoint-every", "0.5", "--checkpoints", ckpts,
        "--", PYTHON, TRAIN, "--steps", "80", "--sleep", "0.05",
        env={"TORPOR_FAULT": "after-dump"}, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    failed = [line for line in r.stderr.splitlines() if "checkpoint failed" in line]
    assert failed, r.stderr
    assert all("fault after-dump forced by TORPOR_FAULT" in line and "keeps running" in line for line in failed), failed
    assert "exited with status 0" in r.stderr
    ref = reference()
    done = steps(log)
    assert [s for s, _ in done] == list(range(1, 81)) and all(loss == ref[s - 1] for s, loss in done)
    assert not list((ckpts / "store" / "refs").iterdir())
    assert sorted(p.name for p in ckpts.iterdir()) == ["lock", "store"], list(ckpts.iterdir())


def test_bad_checkpoint_options_are_refused_in_one_line(torpor: Torpor, tmp_path: Path) -> None:
    cmd = ["--", "true"]
    ck = tmp_path / "ck"
    assert "--keep must be at least 1" in torpor.fails(
        "run", "--checkpoint-every", "1", "--checkpoints", ck, "--keep", "0", *cmd
    )
    assert "--checkpoint-every must be a positive" in torpor.fails(
        "run", "--checkpoint-every", "0", "--checkpoints", ck, *cmd
    )
    assert "--key and --unkeyed seal checkpoints" in torpor.fails("run", "--unkeyed", *cmd)
    # clap refuses a checkpoint option without the other.
    r = torpor("run", "--checkpoint-every", "1", *cmd)
    assert r.returncode == 2 and "--checkpoints" in r.stderr, r.stderr
    # One job per directory, refused before the job starts.
    ck.mkdir()
    with open(ck / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        line = torpor.fails("run", "--checkpoint-every", "1", "--checkpoints", ck, *cmd)
    assert "is in use by another" in line, line
    # A directory with no checkpoint in it.
    (tmp_path / "empty" / "store" / "refs").mkdir(parents=True)
    (tmp_path / "empty" / "store" / "chunks").mkdir()
    line = torpor.fails("restore", tmp_path / "empty")
    assert "holds no checkpoint" in line, line
    line = torpor.fails("restore", tmp_path / "empty", "--checkpoint", "ckpt-00000001")
    assert "has no checkpoint ckpt-00000001 (it holds: none)" in line, line
    # Going on checkpointing needs a checkpoint directory, not a snapshot.
    (tmp_path / "snap").mkdir()
    line = torpor.fails("restore", tmp_path / "snap", "--checkpoint-every", "1")
    assert "is not one (no store/ in it)" in line, line
    line = torpor.fails("restore", tmp_path / "snap", "--checkpoint", "ckpt-00000001")
    assert "--checkpoint picks a checkpoint of a checkpoint directory" in line, line
