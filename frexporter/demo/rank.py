"""One training rank of the demo: world + pair all_reduces per step; one rank skips one pair collective.

Runs as ``python -m frexporter.demo.rank RANK WORLD PORT CONTROL_DIR``. torch is imported here only:
this module runs inside the demo's ranks, never in the exporter.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

HANG_RANK = 3
HANG_STEP = 6
STEP_SECONDS = 0.15


def main() -> None:
    rank, world, port, control = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    from frexporter.recorder import install

    install()  # before init_process_group: turns Flight Recorder on

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    pairs = [dist.new_group([r, r + 1], group_desc=f"pair{r}{r + 1}") for r in range(0, world - 1, 2)]
    pair = pairs[rank // 2] if rank // 2 < len(pairs) else None
    grad = torch.ones(1024)
    hang_rank = min(HANG_RANK, world - 1)
    for step in range(1, 10_000):
        dist.all_reduce(grad)
        if rank == hang_rank and step == HANG_STEP:
            # The injected bug: this rank skips one collective its pair partner is waiting in.
            with open(os.path.join(control, "injected"), "w") as f:
                f.write(f"{time.time()} {step}")
            # Then it computes a while before its next collective, as a training step would: its partner
            # is by then already waiting in the skipped one, which is how the root gets told apart.
            time.sleep(1.0)
        elif pair is not None:
            dist.all_reduce(grad, group=pair)
        time.sleep(STEP_SECONDS)


if __name__ == "__main__":
    main()
