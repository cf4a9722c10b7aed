"""``estimate``: the GPU-free estimate of a training step (activations, phase peaks, fit).

- :mod:`.estimator`: :func:`estimate`, the simulated step under ``FakeTensorMode`` and its write-back;
- :mod:`.attention`: the declared CUDA attention kernel's memory, modelled on the CPU;
- :mod:`.qlora`: bitsandbytes 4-bit layers as bytes under fake tensors;
- :mod:`.extrapolate`: two short traces extended to the full depth;
- :mod:`.fit`: the fit verdict against a device;
- :mod:`.sweep`: the Memory Sensitivity Matrix;
- :mod:`.fitmodel`: every figure as a straight line in the microbatch, from two traced estimates;
- :mod:`.search`: the largest microbatch or sequence length that fits, and the sweep on the model.

Which device (a catalogue of accelerators and GPU counts) is the room above this one and ``shard``:
:mod:`ledgerspec.derivations.devices`.
"""

from ledgerspec.derivations.estimate.estimator import Estimate, estimate

__all__ = ["Estimate", "estimate"]
