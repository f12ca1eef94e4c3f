"""A real gloo rank that writes its own Flight Recorder dump the way torch does, for `frexporter analyze`.

Usage: python dumper.py RANK WORLD PORT OUT_DIR. World all_reduces, then every rank but the last
starts one more (async) that the last rank never joins, and all ranks dump: even ranks as pickle
(``_dump_fr_trace``, what torch writes on a watchdog timeout), odd ranks as JSON.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"

import torch  # noqa: E402
import torch._C._distributed_c10d as c10d_ext  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=60))
sub = dist.new_group(list(range(world)), group_desc="everyone")
t = torch.ones(8)
for _ in range(3):
    dist.all_reduce(t)
dist.all_reduce(t, group=sub)
dist.barrier()
pending = dist.all_reduce(t, async_op=True) if rank != world - 1 else None
data = c10d_ext._dump_fr_trace() if rank % 2 == 0 else c10d_ext._dump_fr_trace_json()
with open(os.path.join(out, f"rank_trace_{rank}"), "wb") as f:
    f.write(data)
os._exit(0)  # the pending all_reduce never completes: that is the point
