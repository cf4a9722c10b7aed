"""A step's full-depth allocation stream in the estimate cache, so that a device asked about for the first time costs
a replay, not three traces.

The device verdict replays the step's stream (:class:`~ledgerspec.derivations.allocator.step.StepEvents`) against
the device; the stream depends on the estimate's inputs and the question (target, layers), never on the device. Kept
as JSON (the cache reads no pickle: a cache folder is never code) compressed with zlib and base64-encoded, about
170 KB for a 7B step of 52,000 events; read back only when every event is one the replay knows (``phase``, ``alloc``,
``free``) with plain values, else traced again.
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

from ledgerspec.derivations.allocator.step import StepEvents

#: bump when the stored form of a stream changes
FORMAT = 1
#: the fields of a stream that are stored (``pattern`` and ``pending`` stay in the process that built it)
_FIELDS = (
    "windows",
    "accumulation",
    "figures",
    "tracker_windows",
    "layers",
    "method",
    "fallback",
    "seconds",
    "build_seconds",
    "estimate_figures",
)
_KINDS = {"phase": 2, "alloc": 4, "free": 2}


def _plain(event: Any) -> bool:
    return (
        isinstance(event, tuple)
        and len(event) > 0
        and len(event) == _KINDS.get(event[0], -1)
        and all(isinstance(x, str | int) and not isinstance(x, bool) for x in event)
    )


def encode(step: StepEvents) -> dict[str, Any] | None:
    """The stream as cache data; None when it holds an event this form does not keep (it is not stored)."""
    if step.pending is not None or not all(_plain(e) for e in step.events):
        return None
    packed = zlib.compress(json.dumps(step.events, separators=(",", ":")).encode(), 6)
    return {
        "format": FORMAT,
        "events": base64.b64encode(packed).decode("ascii"),
        **{name: getattr(step, name) for name in _FIELDS},
    }


def decode(data: dict[str, Any]) -> StepEvents:
    """The stream :func:`encode` stored (``ValueError``/``KeyError``/``TypeError`` for one this version cannot
    read)."""
    if data.get("format") != FORMAT:
        raise ValueError("another stream format")
    events = [tuple(e) for e in json.loads(zlib.decompress(base64.b64decode(data["events"])))]
    if not all(_plain(e) for e in events):
        raise ValueError("an event this form does not keep")
    fields = {name: data[name] for name in _FIELDS}
    fields["tracker_windows"] = {k: tuple(v) for k, v in fields["tracker_windows"].items()}
    return StepEvents(events, **fields)


__all__ = ["FORMAT", "decode", "encode"]
