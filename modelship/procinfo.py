"""What Linux says about a process, for telling a live holder from a recycled pid."""

from __future__ import annotations

from pathlib import Path


def process_start_ticks(pid: int) -> int | None:
    """The process start time in clock ticks since boot (Linux), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; fields after the last ')' are fixed.
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # a zombie has exited; only its parent has not reaped it yet
        return None
    return int(fields[19])
