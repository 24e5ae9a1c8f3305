"""A real replica with a fault injected before its loads: the swap's fault injection.

The swap takes any :class:`~modelship.triton.client.TritonServer`, so a test hands it
these instead of the fleet's replicas; production code carries no test hook. Every load
(each swap phase but an unload is one) first calls ``before_load(replica, versions)`` with
the versions the loaded config serves: raising fails that replica's phase as a failed
load would, sleeping holds the load in flight, and anything else it does (kill the
server, change the repository) happens just before the load is sent.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from modelship.triton.client import TritonServer

BeforeLoad = Callable[[str, list[int]], None]


def served_versions(config_json: str | None) -> list[int]:
    """The versions a config override serves (``version_policy.specific``), else []."""
    policy = json.loads(config_json or "{}").get("version_policy") or {}
    return [int(v) for v in (policy.get("specific") or {}).get("versions", [])]


class FaultyReplica(TritonServer):
    """``server``'s endpoint and timeouts; every load passes ``before_load`` first."""

    def __init__(self, server: TritonServer, before_load: BeforeLoad) -> None:
        super().__init__(server.endpoint, timeout_s=server.timeout_s,
                         control_timeout_s=server.control_timeout_s)
        self.target, self.gpu_count = server.target, server.gpu_count
        self._before_load = before_load

    def load_model(self, name: str, *, config_json: str | None = None,
                   files: dict[str, bytes] | None = None) -> None:
        self._before_load(self.name, served_versions(config_json))
        super().load_model(name, config_json=config_json, files=files)


def first_load_of(version: int, fault: Callable[[str], None]) -> BeforeLoad:
    """A ``before_load`` that calls ``fault(replica)`` before each replica's first load of
    a config serving exactly ``version``: in a swap to ``version``, its switch phase."""
    seen: set[str] = set()

    def before_load(replica: str, versions: list[int]) -> None:
        if versions == [version] and replica not in seen:
            seen.add(replica)
            fault(replica)

    return before_load


@contextmanager
def faulty(replicas: Sequence[TritonServer], before_load: BeforeLoad | None
           ) -> Iterator[list[TritonServer]]:
    """The replicas as the swap should see them: wrapped when a fault is given."""
    if before_load is None:
        yield list(replicas)
        return
    wrapped: list[TritonServer] = [FaultyReplica(r, before_load) for r in replicas]
    try:
        yield wrapped
    finally:
        for replica in wrapped:
            replica.close()
