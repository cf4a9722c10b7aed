"""The kernels users switch on (``software.kernels``), modelled for the simulated step: a room per package
(:mod:`.liger`, :mod:`.cce`) and the patching of the simulated model (:mod:`.apply`). The catalogue of kernel ids
and what each replaces is data in the contract (:mod:`ledgerspec.contract.kernels`)."""
