"""A real gloo rank for the tests: runs a scenario, then idles until told to stop.

Usage: python job.py SCENARIO RANK WORLD PORT CONTROL_DIR
The test drives it through files in CONTROL_DIR (``stop``), and reads ``rank<R>.ready``
once the scenario's collectives are done. The rank never decides when the test is over.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import sys
import time
from datetime import timedelta

scenario, rank, world, port, control = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]

victim = int(os.environ.get("JOB_VICTIM", "1"))
if scenario == "pre_init_fail" and rank == victim:
    sys.exit(3)  # a crash before install() and init_process_group: this rank never publishes anything

if os.environ.get("JOB_INSTALL", "1") == "1":
    from frexporter.recorder import install

    install()

import torch  # noqa: E402  (after install(): the recorder must run before torch sets up FR)
import torch.distributed as dist  # noqa: E402

timeout = timedelta(seconds=float(os.environ.get("JOB_TIMEOUT", "120")))
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=timeout)
t = torch.ones(4)


def ready(tag: str = "ready") -> None:
    path = os.path.join(control, f"rank{rank}.{tag}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def idle() -> None:
    deadline = time.monotonic() + float(os.environ.get("JOB_MAX_LIFETIME", "300"))
    while not os.path.exists(os.path.join(control, "stop")) and time.monotonic() < deadline:
        time.sleep(0.05)


def hold_gil(seconds: float) -> None:
    # A C call that keeps the GIL: Python threads (the recorder's) cannot run meanwhile.
    libc = ctypes.PyDLL(None)
    libc.usleep.argtypes = [ctypes.c_uint]
    libc.usleep(int(seconds * 1e6))


def pass_down_pipeline() -> None:
    """One pipeline stage's p2p: receive from the rank before, send to the rank after (the soaks' p2p traffic)."""
    if rank > 0:
        dist.recv(t, src=rank - 1)
    if rank < world - 1:
        dist.send(t, dst=rank + 1)


def reduce_world() -> None:
    t.fill_(1.0)  # keep the sums finite over hours of steps
    dist.all_reduce(t)


if scenario == "counts":
    # world: 5 collectives; pair (0,1): 3; local-sync subgroup over the odd/even ranks: 2
    # The local-sync group first: torch names it from len(pg_names), which must agree across its ranks.
    evens = [r for r in range(world) if r % 2 == 0]
    odds = [r for r in range(world) if r % 2 == 1]
    mine = evens if rank % 2 == 0 else odds
    local = dist.new_group(mine, use_local_synchronization=True, group_desc="parity")
    pair = dist.new_group([0, 1], group_desc="pair01")
    for _ in range(5):
        dist.all_reduce(t)
    if rank in (0, 1):
        for _ in range(3):
            dist.all_reduce(t, group=pair)
    for _ in range(2):
        dist.all_reduce(t, group=local)
    ready()
    idle()
elif scenario == "p2p":
    # pipeline-style: ranks send to the next and receive from the previous, interleaved with collectives
    for step in range(4):
        if rank > 0:
            dist.recv(t, src=rank - 1)
        if rank < world - 1:
            dist.send(t, dst=rank + 1)
        if rank == 0 and step % 2 == 0:
            dist.send(t, dst=world - 1)
        if rank == world - 1 and step % 2 == 0:
            dist.recv(t, src=0)
        dist.all_reduce(t)
    ready()
    idle()
elif scenario == "blocked":
    # rank 0 enters an all_reduce that rank 1 never joins
    for _ in range(3):
        dist.all_reduce(t)
    if rank == 0:
        ready()
        dist.all_reduce(t)
    else:
        ready()
    idle()
elif scenario == "gil":
    for _ in range(2):
        dist.all_reduce(t)
    ready()
    if rank == 0:
        while not os.path.exists(os.path.join(control, "wedge")):
            time.sleep(0.02)
        ready("wedged")
        hold_gil(float(os.environ.get("JOB_GIL_SECONDS", "8")))
        ready("unwedged")
    idle()
elif scenario == "kill":
    for _ in range(2):
        dist.all_reduce(t)
    ready()
    if rank == 1:
        while not os.path.exists(os.path.join(control, "kill")):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    idle()
elif scenario == "early_kill":
    # A crash at step 0: the victim dies JOB_KILL_AFTER seconds after init_process_group, before any tick
    # of a 1 s snapshot interval could have published it.
    if rank == victim:
        ready("init")  # when init_process_group returned, for benchmarks/startup_death.py
        time.sleep(float(os.environ.get("JOB_KILL_AFTER", "0.5")))
        os.kill(os.getpid(), signal.SIGKILL)
    ready()
    idle()
elif scenario == "pair_skip":
    # The demo's cascade. Each step: compute, all_reduce on WORLD, then on this rank's pair PG ({0,1} or
    # {2,3}). Once the test touches "skip", rank 3 leaves out its pair all_reduce: rank 2 blocks in the
    # pair PG, rank 3 in the next WORLD all_reduce, and ranks 0 and 1 there behind rank 2.
    import threading

    # The ranks end blocked in a collective, deaf to "stop" on the main thread; this lets Job.stop()
    # end them at once instead of after its SIGKILL grace.
    threading.Thread(target=lambda: (idle(), os._exit(0)), daemon=True).start()
    pairs = [dist.new_group([0, 1], group_desc="pair01"), dist.new_group([2, 3], group_desc="pair23")]
    pair = pairs[rank // 2]
    step_seconds = float(os.environ.get("JOB_STEP_SECONDS", "0.2"))
    first = True
    while True:
        # The compute comes before the WORLD op so that a rank skipping its pair op enters the next WORLD
        # op a step's compute after the peer it left waiting: the order that tells root from victim.
        time.sleep(step_seconds)
        dist.all_reduce(t)
        if rank == 3 and os.path.exists(os.path.join(control, "skip")):
            ready("skipped")  # its mtime is when the desync began
        else:
            dist.all_reduce(t, group=pair)
        if first:
            ready()
            first = False
elif scenario == "culprit":
    # rank 0 waits in an all_reduce that rank 1 does not join: rank 1 computes in Python (JOB_CULPRIT=busy)
    # or sleeps (idle) in a function whose name the test looks for among its sampled frames.
    def culprit_busy_checkpoint() -> None:
        # A whole core of work that lets go of the GIL, as a checkpoint's hashing and writing and torch's
        # compute do. With a loop of Python bytecode here (which gives the GIL up only at the switch interval)
        # the recorder's thread fell behind on one 2-core VM, 4 runs in 6: its heartbeat went stale (the rank
        # read as wedged) or the rank was not seen before the test's deadline.
        block = os.urandom(1 << 20)
        while not os.path.exists(os.path.join(control, "stop")):
            for _ in range(20):
                hashlib.sha256(block).digest()

    def culprit_idle_wait_for_data() -> None:
        while not os.path.exists(os.path.join(control, "stop")):
            time.sleep(0.05)

    dist.all_reduce(t)
    ready()
    if rank == 0:
        dist.all_reduce(t)
    elif os.environ.get("JOB_CULPRIT", "busy") == "busy":
        culprit_busy_checkpoint()
    else:
        culprit_idle_wait_for_data()
    idle()
elif scenario == "slow_rank0":
    # A healthy but skewed job: before every all_reduce rank 0 works JOB_SLOW_SECONDS (evaluation, a
    # checkpoint) while the others already wait in the collective.
    import threading

    threading.Thread(target=lambda: (idle(), os._exit(0)), daemon=True).start()
    slow_seconds = float(os.environ.get("JOB_SLOW_SECONDS", "1.5"))
    first = True
    while True:
        if rank == 0:
            time.sleep(slow_seconds)
        dist.all_reduce(t)
        if first:
            ready()
            first = False
elif scenario == "straggler":
    # A healthy job with a consistently late rank: before each of JOB_STEPS all_reduces rank 1 works
    # JOB_LATE_SECONDS longer than the others, which wait for it in the collective every time.
    late_seconds = float(os.environ.get("JOB_LATE_SECONDS", "0.15"))
    for _ in range(int(os.environ.get("JOB_STEPS", "14"))):
        if rank == 1:
            time.sleep(late_seconds)
        dist.all_reduce(t)
    ready()
    idle()
elif scenario == "op_mismatch":
    # Steps of compute and an all_reduce on WORLD. Once the test touches "mismatch", the last rank joins
    # its next collective as an all_gather while the others all_reduce: gloo blocks every rank in the same
    # seq (until the timeout), which only the op each rank recorded tells apart from a network stall.
    import threading

    threading.Thread(target=lambda: (idle(), os._exit(0)), daemon=True).start()
    step_seconds = float(os.environ.get("JOB_STEP_SECONDS", "0.2"))
    first = True
    while True:
        time.sleep(step_seconds)
        if rank == world - 1 and os.path.exists(os.path.join(control, "mismatch")):
            ready("mismatched")  # its mtime is when the mismatch began
            dist.all_gather([torch.empty_like(t) for _ in range(world)], t)
        else:
            dist.all_reduce(t)
        if first:
            ready()
            first = False
elif scenario == "soak":
    # A healthy job for false-positive soaks. Every step each rank computes a random while (up to
    # JOB_JITTER_SECONDS), passes a tensor down a pipeline (send/recv) and all_reduces on WORLD. Every
    # JOB_PAUSE_EVERY steps rank 0 works JOB_PAUSE_SECONDS more (evaluation, a checkpoint), alternately
    # before the pipeline (the others wait in a p2p recv) and before the all_reduce (they wait in it).
    import random
    import threading

    threading.Thread(target=lambda: (idle(), os._exit(0)), daemon=True).start()
    rng = random.Random(rank)
    jitter = float(os.environ.get("JOB_JITTER_SECONDS", "0.2"))
    pause = float(os.environ.get("JOB_PAUSE_SECONDS", "1.0"))
    pause_every = int(os.environ.get("JOB_PAUSE_EVERY", "10"))
    step = 0
    while True:
        time.sleep(rng.uniform(0.0, jitter))
        paused = rank == 0 and step % pause_every == pause_every - 1
        before_pipeline = (step // pause_every) % 2 == 0
        if paused and before_pipeline:
            time.sleep(pause)
        pass_down_pipeline()
        if paused and not before_pipeline:
            time.sleep(pause)
        reduce_world()
        step += 1
        if step == 1:
            ready()
elif scenario == "dp_straggler":
    # benchmarks/straggler.py: a data-parallel job over two nodes. Every step each rank computes
    # JOB_STEP_SECONDS (plus a random share of it up to JOB_JITTER), all_reduces on WORLD and hands a tensor to
    # its peer on the other node (p2p: rank r sends to r + world/2). Once the control file "slow" exists,
    # rank JOB_VICTIM computes JOB_SLOW_FRACTION of a step longer (its marker "slow" says when it began);
    # every JOB_PAUSE_EVERY steps (0: never) rank JOB_PAUSE_RANK pauses JOB_PAUSE_SECONDS (an evaluation).
    import random
    import threading

    threading.Thread(target=lambda: (idle(), os._exit(0)), daemon=True).start()
    rng = random.Random(rank)
    step_seconds = float(os.environ.get("JOB_STEP_SECONDS", "0.5"))
    jitter = float(os.environ.get("JOB_JITTER", "0"))
    slow_fraction = float(os.environ.get("JOB_SLOW_FRACTION", "0.3"))
    pause_every = int(os.environ.get("JOB_PAUSE_EVERY", "0"))
    pause_seconds = float(os.environ.get("JOB_PAUSE_SECONDS", "5"))
    pause_rank = int(os.environ.get("JOB_PAUSE_RANK", "2"))
    half = world // 2
    slow_file = os.path.join(control, "slow")
    step, slowed = 0, False
    while True:
        compute = step_seconds * (1.0 + rng.uniform(0.0, jitter))
        if rank == victim and (slowed or os.path.exists(slow_file)):
            if not slowed:
                ready("slow")
                slowed = True
            compute += slow_fraction * step_seconds
        if pause_every and rank == pause_rank and step % pause_every == pause_every - 1:
            compute += pause_seconds
        time.sleep(compute)
        reduce_world()
        # After the all_reduce, which every rank leaves together: a p2p before it would make the straggler's
        # sender late too (gloo's send waits for the receiver).
        if rank < half:
            dist.send(t, dst=rank + half)
        else:
            dist.recv(t, src=rank - half)
        step += 1
        if step == 1:
            ready()
elif scenario == "steady":
    # A steady job for detection latency: every JOB_STEP_SECONDS an all_reduce on WORLD, then one on the
    # pair {0,1} (ranks 0 and 1). Faults, from control files: "idle": rank JOB_VICTIM stops calling
    # collectives and sleeps (an empty data queue); "kill": it SIGKILLs itself; "deadlock": rank 0 takes
    # the pair op before the WORLD op, so it waits for rank 1 in the pair while rank 1 waits for it in WORLD.
    import threading

    threading.Thread(target=lambda: (idle(), os._exit(0)), daemon=True).start()
    pair = dist.new_group([0, 1], group_desc="pair01")
    step_seconds = float(os.environ.get("JOB_STEP_SECONDS", "0.1"))
    first = True
    while True:
        time.sleep(step_seconds)
        if rank == victim and os.path.exists(os.path.join(control, "idle")):
            ready("idled")
            idle()
            os._exit(0)
        if rank == victim and os.path.exists(os.path.join(control, "kill")):
            ready("killing")
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 0 and os.path.exists(os.path.join(control, "deadlock")):
            ready("deadlocked")
            dist.all_reduce(t, group=pair)
        t.fill_(1.0)
        dist.all_reduce(t)
        if rank in (0, 1):
            dist.all_reduce(t, group=pair)
        if first:
            ready()
            first = False
elif scenario == "checkpoint_soak":
    # A healthy job with the long, legitimate waits of real training, for the false-positive soak at the
    # shipped settings. Steps as in "soak": a random sleep (up to JOB_JITTER_SECONDS), a send/recv pipeline,
    # an all_reduce on WORLD. Rank 0 computes in Python (a whole core: the exporter sees it busy, where a
    # sleep would read idle) for JOB_EVAL_SECONDS every JOB_EVAL_EVERY steps, alternately before the
    # pipeline (the others wait in a p2p recv) and before the all_reduce (they wait in it); and once, at the
    # first step JOB_CHECKPOINT_AFTER seconds after its first, for JOB_CHECKPOINT_SECONDS before the
    # all_reduce. Rank 0 logs each as "KIND START END" (unix seconds) in rank0.busy.log.
    import random
    import threading

    threading.Thread(target=lambda: (idle(), os._exit(0)), daemon=True).start()
    rng = random.Random(rank)
    jitter = float(os.environ.get("JOB_JITTER_SECONDS", "0.3"))
    eval_every = int(os.environ.get("JOB_EVAL_EVERY", "200"))
    eval_seconds = float(os.environ.get("JOB_EVAL_SECONDS", "20"))
    checkpoint_after = float(os.environ.get("JOB_CHECKPOINT_AFTER", "200"))
    checkpoint_seconds = float(os.environ.get("JOB_CHECKPOINT_SECONDS", "180"))

    def log_busy(kind: str, start: float) -> None:
        with open(os.path.join(control, f"rank{rank}.busy.log"), "a") as f:
            f.write(f"{kind} {start:.3f} {time.time():.3f}\n")

    # The loops are inline so that the sampled stack's innermost frame, the culprit's headline function
    # (culprit_function), is evaluate or save_checkpoint.
    def evaluate() -> None:
        start, x = time.time(), 0
        deadline = time.monotonic() + eval_seconds
        while time.monotonic() < deadline:
            for i in range(10_000):
                x += i * i
        log_busy("eval", start)

    def save_checkpoint() -> None:
        start, x = time.time(), 0
        deadline = time.monotonic() + checkpoint_seconds
        while time.monotonic() < deadline:
            for i in range(10_000):
                x += i * i
        log_busy("checkpoint", start)

    started = time.monotonic()
    checkpointed = False
    step = 0
    while True:
        time.sleep(rng.uniform(0.0, jitter))
        checkpoint = rank == 0 and not checkpointed and time.monotonic() - started >= checkpoint_after
        evaluating = rank == 0 and not checkpoint and step % eval_every == eval_every - 1
        before_pipeline = (step // eval_every) % 2 == 0
        if evaluating and before_pipeline:
            evaluate()
        pass_down_pipeline()
        if evaluating and not before_pipeline:
            evaluate()
        if checkpoint:
            save_checkpoint()
            checkpointed = True
        reduce_world()
        step += 1
        if step == 1:
            ready()
elif scenario in ("gpu_spin", "async_spin"):
    # A busy steady state, as a healthy GPU rank is: each step the rank spins (CUDA's synchronization burns a
    # core) for JOB_STEP_SECONDS, then an all_reduce. CUDA is faked at its boundary (this CPU build has none):
    # torch.cuda says it is initialized with memory on device 0, and its default stream has work pending once
    # the control file "gpu_hang" exists. Faults: "gpu_hang": rank JOB_VICTIM waits on its GPU as .item() does,
    # spinning on one line; "async_hang" (two ranks): rank 0 issues its all_reduces with async_op=True and spins
    # on work.is_completed() (how an NCCL rank waits: outside the collective call), and once it has, rank
    # JOB_VICTIM stops joining.
    import threading
    from types import SimpleNamespace

    threading.Thread(target=lambda: (idle(), os._exit(0)), daemon=True).start()
    gpu_hang = os.path.join(control, "gpu_hang")
    async_hang = os.path.join(control, "async_hang")

    class FakeDefaultStream:
        def query(self) -> bool:
            return not os.path.exists(gpu_hang)

    cuda = sys.modules["torch.cuda"]
    cuda.is_initialized = lambda: True
    cuda.device_count = lambda: 1
    cuda.memory_reserved = lambda device=None: 1 << 20
    cuda.default_stream = lambda device=None: FakeDefaultStream()
    cuda.get_device_properties = lambda device: SimpleNamespace(uuid="GPU-00000000-fake-0000-0000-000000000000")
    step_seconds = float(os.environ.get("JOB_STEP_SECONDS", "0.05"))

    def spin(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end: pass  # noqa: E701 (one line: the stack stands still, as in a CUDA sync)

    def wait_on_gpu() -> None:
        while True: pass  # noqa: E701 (.item() behind a kernel that never ends)

    first = True
    while True:
        spin(step_seconds)
        if rank == victim and os.path.exists(gpu_hang):
            ready("hung")
            wait_on_gpu()
        if rank == victim and os.path.exists(os.path.join(control, "rank0.async")):
            ready("hung")  # rank 0 has gone async: from its next all_reduce on, it waits outside the call
            idle()
            os._exit(0)
        t.fill_(1.0)
        if rank == 0 and os.path.exists(async_hang):
            ready("async")
            work = dist.all_reduce(t, async_op=True)
            while not work.is_completed(): pass  # noqa: E701 (an NCCL-style wait: outside the collective call)
        else:
            dist.all_reduce(t)
        if first:
            ready()
            first = False
elif scenario == "early_exit":
    # An uneven last batch: every rank runs JOB_STEPS all_reduces, then rank JOB_VICTIM has no batch left and
    # exits cleanly (sys.exit: atexit runs, the recorder says goodbye), while the others enter one more
    # all_reduce that it never joins. Its exit then waits for "release" (hold_exit).
    import threading

    if rank != victim:
        # Blocked in the last all_reduce, deaf to "stop" on the main thread: this ends it at once.
        threading.Thread(target=lambda: (idle(), os._exit(0)), daemon=True).start()
    step_seconds = float(os.environ.get("JOB_STEP_SECONDS", "0.2"))  # the recorder publishes meanwhile
    for _ in range(int(os.environ.get("JOB_STEPS", "3"))):
        time.sleep(step_seconds)
        dist.all_reduce(t)
    if rank == victim:
        import atexit

        from frexporter.recorder import install as recorder

        def hold_exit() -> None:
            """The end of a slow interpreter exit, after the recorder's goodbye: the process and its gloo
            connections stay until the test touches "release" (or "stop"). Gone, it would take them along and
            gloo would abort its peers' wait at once, where NCCL's peers wait for their watchdog."""
            deadline = time.monotonic() + float(os.environ.get("JOB_MAX_LIFETIME", "300"))
            while time.monotonic() < deadline and not any(
                    os.path.exists(os.path.join(control, name)) for name in ("release", "stop")):
                time.sleep(0.05)

        publisher = recorder()  # the one install() started: atexit runs the last registered first
        if publisher is not None:
            atexit.unregister(publisher.stop)
        atexit.register(hold_exit)
        if publisher is not None:
            atexit.register(publisher.stop)
        ready()
        sys.exit(0)
    ready()
    try:
        dist.all_reduce(t)  # the batch the victim does not have
    except RuntimeError:
        ready("aborted")  # gloo gave up once the victim's process (and its connections) went
    idle()
else:
    raise SystemExit(f"unknown scenario {scenario}")

os._exit(0)  # skip destroy_process_group: peers may be gone or blocked, which is the point
