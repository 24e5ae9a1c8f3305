"""One canary at a time on the canary Triton.

Every model's canary runs on the same canary server. Two at once would each measure the
other's load in their latency evidence (and in their server-side figures), so a canary
holds the canary slot (:func:`modelship.locks.canary_slot`, a lease in the bucket) from
before it loads its versions until it has unloaded them: a second canary queues, says
whom it waits for, and gives up after :data:`modelship.locks.CANARY_SLOT_WAIT_S`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from modelship.locks import CANARY_SLOT_WAIT_S, canary_slot

P = ParamSpec("P")
R = TypeVar("R")


def in_canary_slot(run: Callable[P, R]) -> Callable[P, R]:
    """Run ``run_canary(settings, clients, policy, *, model, candidate, ..., progress)``
    inside the canary slot (the slot is keyed by the bucket: one per canary server)."""

    @functools.wraps(run)
    def held(*args: P.args, **kwargs: P.kwargs) -> R:
        clients: Any = args[1] if len(args) > 1 else kwargs["clients"]
        model, candidate = str(kwargs["model"]), kwargs["candidate"]
        progress: Callable[[str], None] | None = kwargs.get("progress")  # type: ignore[assignment]
        with canary_slot(clients.storage, model=model, progress=progress,
                         owner=f"canary of {model} v{candidate} (pid {os.getpid()})",
                         wait_s=CANARY_SLOT_WAIT_S):
            return run(*args, **kwargs)

    return held
