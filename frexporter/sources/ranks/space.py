"""Room on the spool's filesystem for a rank to publish: one ``statvfs`` of the open spool directory per poll.

A rank that starts on a full filesystem cannot write its manifest, so it never appears: it trains on and counts
``enospc`` in a snapshot nobody can read. Only the exporter's side can say so. The rule is pure (``shortage``); the
source counts ``reasons.SPOOL_FULL`` once per poll while it holds, and logs when it starts and ends.
"""

from __future__ import annotations

import os

from frexporter.spool import MAP_INITIAL_CAPACITY

# What a node's ranks need to publish, for unprivileged users (ranks do not run as root): each writes a starting
# manifest, then its full manifest (about a KiB, more with many process groups; each written beside the old one
# and renamed over it) and a mapped snapshot created full size (64 KiB), and makes a socket. Eight ranks' worth:
MIN_FREE_BYTES = 8 * 2 * MAP_INITIAL_CAPACITY  # 1 MiB
# Each rank takes four to five inodes at once (manifest, snapshot, socket, a temporary file being renamed).
MIN_FREE_INODES = 64


def shortage(st: os.statvfs_result) -> str | None:
    """What the spool's filesystem lacks for a rank to publish (its free bytes and inodes), or None when it has
    room. A filesystem that counts no inodes (``f_files`` 0: btrfs, some network filesystems) lacks none."""
    free = st.f_bavail * st.f_frsize
    low = []
    if free < MIN_FREE_BYTES:
        low.append(f"{free} bytes free")
    if st.f_files > 0 and st.f_favail < MIN_FREE_INODES:
        low.append(f"{st.f_favail} inodes free")
    if not low:
        return None
    return (f"the spool's filesystem is full ({', '.join(low)}; a rank needs {MIN_FREE_BYTES} bytes and "
            f"{MIN_FREE_INODES} inodes for unprivileged users): ranks starting now cannot publish and are not seen "
            f"here; those running count enospc in frexporter_rank_recorder_errors_total")
