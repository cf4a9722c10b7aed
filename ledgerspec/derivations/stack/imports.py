"""The stack's first import in a ``ledgerspec`` command, with Python's cyclic garbage collector paused.

Importing torch, transformers and peft makes a few million long-lived objects (modules, functions, classes). While
they are made, the cyclic collector runs its full collection several times, each walking everything imported so
far: 7 full collections, 0.58 s of a 5 s cold ``ledgerspec estimate`` of the 7B LoRA example (measured with
``gc.callbacks``; the step that follows ran none). The ``estimate``, ``shard`` and ``resolve`` commands set
:data:`PAUSE_GC` (:func:`ledgerspec.faces.preflight.import_stack_quietly`); the first :func:`import_stack` (called
where the stack is first needed: :func:`ledgerspec.derivations.stack.build.load_config`, the resolver's first
import) clears it again and imports the stack with the collector off, runs one full
collection (so the collector's count of the long-lived heap is what it would have been: the step that follows runs
no full collection it would not have run), moves everything imported into the permanent generation
(``gc.freeze``: later collections skip it) and turns the collector back on. The simulated or measured step runs
with the collector on and its thresholds unchanged; only the import is cheaper. A cycle's collection could still
move by a few hundred allocations (the young generation starts empty), as it moves with whatever a process imported
before: ``tests/derivations/stack/test_imports.py`` checks that a paused command's estimate is the in-process one,
figure for figure. A library caller (``PAUSE_GC`` false) imports as usual: no global state of its process is
touched.
"""

from __future__ import annotations

import gc
import importlib
import sys

#: set by the command line: pause the collector during the stack's first import (see the module docstring)
PAUSE_GC = False
#: what the first import brings in (what every estimate, shard and resolve imports anyway)
STACK = ("torch", "transformers.modeling_utils", "peft")


def import_stack(modules: tuple[str, ...] = STACK) -> None:
    """With :data:`PAUSE_GC` set, the collector on and none of ``modules`` imported yet: import them now with the
    collector paused (an absent one is skipped: the code that needs it says so), then collect, freeze and turn it
    back on. Otherwise nothing: the callers import what they need as usual. Idempotent."""
    global PAUSE_GC
    pause, PAUSE_GC = PAUSE_GC, False  # one import per request: a later library call in this process is left alone
    if not pause or any(name.split(".")[0] in sys.modules for name in modules) or not gc.isenabled():
        return
    from ledgerspec.derivations.stack.quiet import quiet_bitsandbytes

    gc.disable()
    try:
        for name in modules:
            try:
                if name == "peft":  # peft imports bitsandbytes: quietly, its torch.compile deferred
                    quiet_bitsandbytes()
                importlib.import_module(name)
            except ImportError:
                continue
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()


__all__ = ["PAUSE_GC", "STACK", "import_stack"]
