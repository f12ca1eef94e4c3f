"""Whether a rank whose Python stands still is waiting on its GPU (inside the rank, off the training thread).

CUDA's default synchronization spins a CPU core: a rank whose training thread waits in ``Tensor.item()``,
``torch.cuda.synchronize()``, ``.cpu()`` or an event is at 100 % CPU with its stack frozen on one line, which
from CPU use and stack alone looks like a rank computing. So, only while the recorder finds the training
thread's stack frozen (the same frames in two samples in a row), the probe asks CUDA whether the rank's device
still has work queued on its default stream, and the snapshot says for how long it has had (``gpu_wait``).

What it sees: the legacy default stream of the rank's device (where torch runs work unless the code chose
another stream), which a never-ending kernel, or a copy queued behind one, keeps busy. What it misses: work on
streams the code created itself (``torch.cuda.Stream``), and NCCL's own streams; a rank waiting on its own
in-flight collective is judged from Flight Recorder instead (the exporter's ``in_collective``).

Rules it keeps (it runs in the rank):

- It never imports torch and never creates a CUDA context: nothing happens until ``torch.cuda`` is imported
  and initialized by the rank, and only a device on which the rank already holds memory (so its context
  exists) is queried. The recorder thread's current device and stream are its own, not the training
  thread's, so the device is found from the allocator and ``LOCAL_RANK`` (``rank_device``).
- The query runs on its own daemon thread, so a query that blocks (a hung driver) never stops the
  snapshots; one that takes over ``QUERY_DEADLINE`` seconds, raises ``MAX_FAILURES`` times, or answers
  something that is not a bool turns the probe off, counted in the recorder's errors (``reasons.CUDA_PROBE``).
  torch's ``Stream.query()`` holds the GIL for ``cudaStreamQuery``, a non-blocking call of microseconds; a
  driver hang that blocks even that one freezes the rank's Python, which the exporter reports as ``wedged``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from frexporter import reasons

# Seconds one query may take before the probe turns itself off (cudaStreamQuery takes microseconds).
QUERY_DEADLINE = 5.0
# Failed queries (an exception) before the probe turns itself off.
MAX_FAILURES = 3


def torch_cuda() -> Any | None:
    """``torch.cuda`` if the rank imported it; never imports it."""
    return sys.modules.get("torch.cuda")


def cuda_ready(cuda: Any | None) -> bool:
    """The rank has initialized CUDA (``is_initialized`` reads a flag: no context is created)."""
    try:
        return cuda is not None and bool(cuda.is_initialized())
    except Exception:
        return False


def rank_device(cuda: Any, environ: Mapping[str, str]) -> int | None:
    """The CUDA device index this rank computes on, as the rank numbers them (after CUDA_VISIBLE_DEVICES), or
    None when it holds memory on none.

    Only devices where the rank's caching allocator holds memory count: their contexts exist, so querying them
    creates none. One such device is the answer; several (a rank that touched more than one GPU) are decided
    by ``LOCAL_RANK``, the launchers' convention for a rank's device, else the lowest.
    """
    used = [i for i in range(int(cuda.device_count())) if int(cuda.memory_reserved(i)) > 0]
    if len(used) <= 1:
        return used[0] if used else None
    local = environ.get("LOCAL_RANK", "")
    if local.isascii() and local.isdigit() and int(local) in used:
        return int(local)
    return used[0]


def device_uuid(cuda: Any, device: int) -> str:
    """``GPU-<uuid>`` of ``device``, as NVML names it; "" when torch does not say."""
    uuid = str(getattr(cuda.get_device_properties(device), "uuid", ""))
    return uuid if uuid.startswith("GPU-") or not uuid else f"GPU-{uuid}"


class CudaProbe:
    """``sample(frozen)`` once per snapshot: the snapshot's ``gpu_wait`` items, ``b"<device>,<ms>"`` while the
    rank's device has had work pending for ``ms`` milliseconds (as far as the probe has seen, with the stack
    frozen), else ``b""``. Never raises, never blocks."""

    def __init__(
        self,
        count_error: Callable[[str, BaseException], None],
        cuda: Callable[[], Any | None] = torch_cuda,
        environ: Mapping[str, str] = os.environ,
        clock: Callable[[], float] = time.monotonic,
        deadline: float = QUERY_DEADLINE,
    ) -> None:
        self._count_error = count_error
        self._cuda = cuda
        self._environ = environ
        self._clock = clock
        self._deadline = deadline
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._off = False
        self._failures = 0
        self._errors: list[BaseException] = []  # raised on the query thread, counted on the recorder's
        self._asked_at: float | None = None  # when the query now running started
        self._device: int | None = None
        self._pending_since: float | None = None  # written by the query thread only
        self._answer: tuple[int, float] | None = None  # (device, pending since), the last query's
        self._restart = False  # the stack moved: the next query starts counting anew

    @property
    def off(self) -> bool:
        return self._off

    def sample(self, frozen: bool) -> bytes:
        try:
            return self._sample(frozen)
        except Exception as e:  # never into the snapshot's caller
            self._turn_off(e)
            return b""

    def close(self) -> None:
        self._off = True
        self._wake.set()

    def _sample(self, frozen: bool) -> bytes:
        while self._errors:
            self._count_error(reasons.CUDA_PROBE, self._errors.pop())
        if self._off:
            return b""
        asked = self._asked_at
        if asked is not None and self._clock() - asked > self._deadline:
            self._turn_off(TimeoutError(f"a CUDA stream query has not returned in {self._deadline:g} s"))
            return b""
        if not frozen:
            self._answer, self._restart = None, True
            return b""
        if self._thread is None:
            if not cuda_ready(self._cuda()):
                return b""  # the rank has not touched CUDA: nothing to ask, and asking must not create a context
            self._thread = threading.Thread(target=self._run, name="frexporter-cuda-probe", daemon=True)
            self._thread.start()
        answer = self._answer
        self._wake.set()  # the next answer, for the next snapshot
        if answer is None:
            return b""
        device, since = answer
        return b"%d,%d" % (device, max(0, round((self._clock() - since) * 1000)))

    def _turn_off(self, error: BaseException) -> None:
        if not self._off:
            self._off = True
            self._wake.set()
            self._count_error(reasons.CUDA_PROBE, error)

    def _run(self) -> None:
        while not self._off:
            self._wake.wait()
            self._wake.clear()
            if self._off:
                return
            self._asked_at = self._clock()
            try:
                pending = self._query()
            except Exception as e:
                self._failures += 1
                self._errors.append(e)
                if self._failures >= MAX_FAILURES:
                    self._off = True
                pending = None
            finally:
                self._asked_at = None
            now = self._clock()
            if self._restart:
                self._pending_since, self._restart = None, False
            if pending is None or self._device is None:
                self._pending_since, self._answer = None, None
                continue
            if not pending:
                self._pending_since, self._answer = None, None
                continue
            if self._pending_since is None:
                self._pending_since = now
            self._answer = (self._device, self._pending_since)

    def _query(self) -> bool | None:
        """True while the rank's device has work queued on its default stream; None without a device."""
        cuda = self._cuda()
        if cuda is None:
            return None
        if self._device is None:
            self._device = rank_device(cuda, self._environ)
            if self._device is None:
                return None
        done = cuda.default_stream(self._device).query()
        if not isinstance(done, bool):
            self._off = True
            raise TypeError(f"stream query answered {type(done).__name__}, not a bool")
        return not done
