"""``devices``: which device: the estimate of a ledger against a catalogue of accelerators and GPU counts
(``estimate --devices``), above both ``estimate`` (a traced step per microbatch) and ``shard`` (a simulated step
per GPU count when the ledger declares FSDP).

- :mod:`.catalogue`: the accelerators (``devices.yaml``, shipped with the package, and a user file on top);
- :mod:`.comparison`: :func:`compare`, every device for every GPU count: fits, headroom, largest microbatch;
- :mod:`.outside`: what a rank holds outside PyTorch's caching allocator (``outside.yaml``: the CUDA context by
  architecture, NCCL's buffers, unified memory; the cuBLAS workspaces listed as inside), per declared stack, with
  sources; a ledger's ``outside_allocator.total`` replaces it;
- :mod:`.target`: which device a verdict is asked for (:func:`~.target.target_of`: named by the ledger, the
  catalogue or ``software.gpu_name``; the total its allocator can ever get) and what one rank holds outside the
  allocator there (:func:`~.target.outside_of`: the ledger's figure for its own ranks and card, else the catalogue's);
- :mod:`.prediction`: :func:`~.prediction.estimate_on_device`, the estimate's step on one device: the allocator
  model's reserved bytes per phase (the full-depth stream of :mod:`ledgerspec.derivations.allocator`), plus what lies
  outside the allocator, and the verdict: the replay against the capacity the allocator can get completes or not
  (and, when what lies outside is the catalogue's range, whether it completes with the high end too: else at the
  edge, which does not fit);
- :mod:`.per_rank`: each rank of a sharded step (``shard --estimate``) decided on the device as one GPU is;
- :mod:`.fit_check`, :mod:`.sweep_check`: the largest value of ``--fit``, and the configuration a sweep or a what-if
  names, checked on the device; :mod:`.along`: those checks' streams synthesised along the microbatch from two
  traced ones.
"""

from ledgerspec.derivations.devices.comparison import Comparison, compare

__all__ = ["Comparison", "compare"]
