"""The step engine: one training step of a document, run on real or fake tensors and counted phase by phase.

- :mod:`.workload`: the model, optimizer and batches a document declares (shared by measure, estimate, shard);
- :mod:`.tracker`: a dispatch-level tracker of every live tensor storage, by category;
- :mod:`.fakemode`: the fake-tensor mode a traced step runs under (PyTorch's, with two costs taken out);
- :mod:`.protocol`: the measurement protocol's phases over a memory backend (tracker or CUDA allocator);
- :mod:`.beside`: two independent simulations at once, the second in a forked process.
"""

from ledgerspec.derivations.engine.protocol import ProtocolResult, run_protocol
from ledgerspec.derivations.engine.tracker import MemoryTracker
from ledgerspec.derivations.engine.workload import Workload, WorkloadSpec

__all__ = ["MemoryTracker", "ProtocolResult", "Workload", "WorkloadSpec", "run_protocol"]
