"""The kernels users switch on (``software.kernels``), modelled for the simulated step: a room per package
(:mod:`.liger`, :mod:`.cce`, :mod:`.axolotl`) and the patching of the simulated model (:mod:`.apply`,
:func:`simulated_kernels`). The catalogue of kernel ids and what each replaces is data in the contract
(:mod:`ledgerspec.contract.kernels`)."""

from ledgerspec.derivations.kernels.apply import simulated_kernels

__all__ = ["simulated_kernels"]
