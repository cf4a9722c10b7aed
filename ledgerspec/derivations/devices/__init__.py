"""``devices``: which device: the estimate of a ledger against a catalogue of accelerators and GPU counts
(``estimate --devices``), above both ``estimate`` (a traced step per microbatch) and ``shard`` (a simulated step
per GPU count when the ledger declares FSDP).

- :mod:`.catalogue`: the accelerators (``devices.yaml``, shipped with the package, and a user file on top);
- :mod:`.comparison`: :func:`compare`, every device for every GPU count: fits, headroom, largest microbatch;
- :mod:`.outside`: what a rank holds outside PyTorch's caching allocator (``outside.yaml``: the CUDA context by
  architecture, NCCL's buffers, unified memory; the cuBLAS workspaces listed as inside), per declared stack, with
  sources; a ledger's ``outside_allocator.total`` replaces it.
"""

from ledgerspec.derivations.devices.comparison import Comparison, compare

__all__ = ["Comparison", "compare"]
