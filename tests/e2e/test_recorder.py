"""The in-rank recorder: idempotent, never raises, never imports torch on its own, reports its own failures.

Its unit tests are in tests/unit/test_recorder.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from frexporter import spool
from tests.harness import REPO

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def gloo_rank(spool_dir: Path) -> str:
    """The start of a one-rank gloo job's script: the recorder installed into ``spool_dir`` as ``pub``, the
    default process group up, ``os``, ``time``, ``json``, ``spool``, ``torch`` and ``dist`` imported."""
    return (
        "import os, time, json\n"
        "from frexporter import spool\n"
        "from frexporter.recorder import install\n"
        f"pub = install({str(spool_dir)!r})\n"
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
    )


def python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**ENV, **env})


def test_install_is_idempotent_and_does_not_import_torch(tmp_path: Path) -> None:
    out = python(
        "import sys, threading, time\n"
        "from frexporter.recorder import install\n"
        f"a = install({str(tmp_path)!r}); b = install(); c = install({str(tmp_path / 'other')!r})\n"
        # Let the recorder thread tick a few times (it would import torch then, if it ever did).
        "ticks = threading.Semaphore(0)\n"
        "real_tick = a.tick\n"
        "a.tick = lambda: (real_tick(), ticks.release())\n"
        "assert all(ticks.acquire(timeout=30) for _ in range(3))\n"
        "print(a is b is c, a.alive, 'torch' in sys.modules)\n",
        FREXPORTER_SNAPSHOT_INTERVAL="0.05",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "False"]
    assert (tmp_path.stat().st_mode & 0o777) == 0o700


def test_install_into_an_unusable_directory_warns_and_returns_none(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = python(
        "from frexporter.recorder import install\n"
        f"print(install({str(blocker / 'spool')!r}))\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"
    assert "frexporter recorder disabled" in out.stderr


def test_install_sets_flight_recorder_buffer_before_first_pg() -> None:
    out = python(
        "import os\nfrom frexporter.recorder import install\n"
        "install('/tmp/frexporter-test-env')\n"
        "print(os.environ['TORCH_FR_BUFFER_SIZE'], os.environ['TORCH_NCCL_TRACE_BUFFER_SIZE'])\n"
    )
    assert out.stdout.split() == ["2000", "2000"]
    out = python(
        "import os\nfrom frexporter.recorder import install\n"
        "install('/tmp/frexporter-test-env')\nprint(os.environ['TORCH_FR_BUFFER_SIZE'])\n",
        TORCH_FR_BUFFER_SIZE="50",
    )
    assert out.stdout.strip() == "50"  # the user's choice wins


def test_recorder_thread_death_is_reported_not_silent(tmp_path: Path) -> None:
    code = (
        "import os, time, json\n"
        "from frexporter.recorder import install\n"
        f"pub = install({str(tmp_path)!r})\n"
        "import torch, torch.distributed as dist\n"
        # torch's status call fails with a BaseException on the fifth snapshot: by then the steady state's bound
        # snapshot function runs (the recorder binds it after its first snapshot).
        "ext, calls = torch._C._distributed_c10d, []\n"
        "real = ext._dump_fr_trace_json\n"
        "def flaky(*a):\n"
        "    calls.append(pub._snapshot is not None)\n"
        "    if len(calls) == 5: raise SystemExit('simulated bug')\n"
        "    return real(*a)\n"
        "ext._dump_fr_trace_json = flaky\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "deadline = time.time() + 30\n"
        "while pub.alive and time.time() < deadline: time.sleep(0.02)\n"
        "print(pub.alive, calls)\n"
        "os._exit(0)\n"
    )
    out = python(code, FREXPORTER_SNAPSHOT_INTERVAL="0.05")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False [False, True, True, True, True]"
    assert "recorder thread died" in out.stderr
    snap = spool.read_snapshot_map(str(next(tmp_path.glob("*" + spool.SNAPSHOT_MAP_SUFFIX))))
    assert snap["state"] == "stopped" and "simulated bug" in snap["message"]


def test_disk_full_while_writing_snapshots_is_counted_and_training_continues(tmp_path: Path) -> None:
    # A spool on a 64 KiB tmpfs would need mount rights; /dev/full gives ENOSPC on every write instead.
    # Updates of the mapped snapshot cannot run out of space (its blocks exist from the start): the disk can
    # be full when the file is (re)created, which happens here on every snapshot until there is room again.
    code = gloo_rank(tmp_path) + (
        "deadline = time.time() + 30\n"
        "while pub._counter < 3 and time.time() < deadline: time.sleep(0.02)\n"
        "real = spool.SnapshotMap._create\n"
        "def full(self, size, payload):\n"
        "    with open('/dev/full', 'wb') as f: f.write(b'x' * 10); f.flush()\n"
        "spool.SnapshotMap._create = full\n"
        "pub._map.close()  # as after the spool directory was removed: the next snapshot creates its file\n"
        "t = torch.ones(4)\n"
        "# Training goes on while the disk is full, until the recorder has failed a few snapshots (deadline above).\n"
        "while pub.errors.get('enospc', 0) < 3 and time.time() < deadline: dist.all_reduce(t); time.sleep(0.01)\n"
        "spool.SnapshotMap._create = real\n"
        "path = next(p for p in os.listdir(pub.directory) if p.endswith(spool.SNAPSHOT_MAP_SUFFIX))\n"
        "def errors_on_disk():\n"
        "    try: return spool.read_snapshot_map(os.path.join(pub.directory, path))['errors'].get('enospc', 0)\n"
        "    except spool.SpoolError: return 0\n"
        "while not errors_on_disk() and time.time() < deadline: time.sleep(0.02)\n"
        "print(json.dumps({'alive': pub.alive, 'errors': pub.errors, 'sum': t.sum().item()}))\n"
        "os._exit(0)\n"
    )
    out = python(code, FREXPORTER_SNAPSHOT_INTERVAL="0.05")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["alive"] and result["sum"] == 4.0
    assert result["errors"].get("enospc", 0) >= 1
    assert out.stderr.count("enospc") == 1  # logged once, counted every time
    snap = spool.read_snapshot_map(str(next(tmp_path.glob("*" + spool.SNAPSHOT_MAP_SUFFIX))))
    assert snap["errors"]["enospc"] >= 1  # the exporter gets to see it once the disk has room again


def test_spool_directory_deleted_and_recreated(job_factory, exporter_factory) -> None:
    import shutil

    from frexporter.model import RANK_OK
    from tests.harness import wait_for

    job = job_factory("counts", 2)
    job.wait_ready()
    exp = exporter_factory(job.spool)
    wait_for(lambda: len(exp.snapshot.ranks) == 2, timeout=20, what="both ranks")
    # Rename first: the ranks write into the directory all the time, and rmtree would race them.
    gone = job.spool.with_name("spool.removed")
    job.spool.rename(gone)
    shutil.rmtree(gone)
    # The exporter serves an empty node meanwhile; the ranks put their files (and sockets) back.
    wait_for(lambda: all(r.status == RANK_OK for r in exp.snapshot.ranks) and len(exp.snapshot.ranks) == 2
             and all(r.pgs for r in exp.snapshot.ranks) and job.spool.exists()
             and len(list(job.spool.glob("*.sock"))) == 2, timeout=20, what="ranks back after the spool was recreated")
    # The new sockets answer: the exporter reads the ranks' FR entries again.
    deleted_at = max(p.stat().st_mtime for p in job.spool.glob("*.sock"))
    wait_for(lambda: all((r.last_deep_read or 0) > deleted_at for r in exp.snapshot.ranks)
             or all(r.socket_alive is not False for r in exp.snapshot.ranks), timeout=20)


def test_destroyed_and_recreated_process_group_is_published_again(tmp_path: Path) -> None:
    # After identification the recorder reads only the PG table's size (destroy_process_group() empties it)
    # instead of is_initialized(): snapshots pause while it is empty and resume, with a new manifest, after a
    # new init_process_group().
    code = gloo_rank(tmp_path) + (
        "def wait(cond):\n"
        "    deadline = time.time() + 30\n"
        "    while not cond() and time.time() < deadline: time.sleep(0.02)\n"
        "    assert cond()\n"
        "dist.new_group([0])\n"
        "wait(lambda: pub._counter >= 3)\n"
        "gen = pub._generation\n"
        "dist.destroy_process_group()\n"
        "wait(lambda: pub._pg_names is not None and not pub._pg_names)\n"
        "paused = pub._counter\n"
        "import threading\n"
        "ticks, real_tick = threading.Semaphore(0), pub.tick\n"
        "pub.tick = lambda: (real_tick(), ticks.release())\n"
        "assert all(ticks.acquire(timeout=30) for _ in range(5))  # five ticks while the table is empty\n"
        "print(pub._counter - paused)\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "wait(lambda: pub._counter >= paused + 3 and pub._generation > gen)\n"
        "path = pub._path(spool.MANIFEST_SUFFIX)\n"
        "print(len(spool.parse_manifest(json.load(open(path))).process_groups), pub.errors)\n"
        "dist.destroy_process_group()\n"
    )
    out = python(code, FREXPORTER_SNAPSHOT_INTERVAL="0.05")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["0", "1 {}"]


def test_stack_is_sampled_only_while_the_rank_makes_no_collective_progress(tmp_path: Path) -> None:
    # A rank that completes collectives is nobody's culprit: its snapshots carry no stack, and training pays
    # nothing for one. Once it stops (here: parked in a named function), the stack comes within two snapshots.
    code = gloo_rank(tmp_path) + (
        "t = torch.ones(4)\n"
        "deadline = time.time() + 60\n"
        "def snap():\n"
        "    while time.time() < deadline:\n"
        "        try:\n"
        "            path = next(p for p in os.listdir(pub.directory) if p.endswith(spool.SNAPSHOT_MAP_SUFFIX))\n"
        "            return spool.read_snapshot_map(os.path.join(pub.directory, path))\n"
        "        except (StopIteration, spool.SpoolError): time.sleep(0.01)\n"
        "progressing = {}\n"
        "while len(progressing) < 12 and time.time() < deadline:\n"
        "    dist.all_reduce(t)\n"
        "    s = snap(); progressing[s['counter']] = len(s['stack'])\n"
        "def parked_in_this_function():\n"
        "    while time.time() < deadline:\n"
        "        s = snap()\n"
        "        if s['stack']: return s['stack']\n"
        "        time.sleep(0.01)\n"
        "stack = parked_in_this_function()\n"
        "print(json.dumps({'progressing': progressing, 'stack': stack}))\n"
        "os._exit(0)\n"
    )
    out = python(code, FREXPORTER_SNAPSHOT_INTERVAL="0.05")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # The first two snapshots after the process group appears carry a stack, before it is known whether the
    # rank progresses (the whole write, then the first of the fast path); every later one while all_reduce
    # runs has none.
    later = {int(counter): frames for counter, frames in result["progressing"].items()}
    for counter in sorted(later)[:2]:
        del later[counter]
    assert len(later) >= 8 and set(later.values()) == {0}, result
    assert "parked_in_this_function" in [frame[0] for frame in result["stack"]], result["stack"]
