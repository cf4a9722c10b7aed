"""A workload sharded with FSDP2: ``fully_shard`` per decoder layer + root on the meta device, shards materialised.

Shared by ``measure --nproc`` (:mod:`ledgerspec.derivations.measure_dist`, real tensors, one process per rank
under torchrun) and the per-rank estimate (:mod:`ledgerspec.derivations.sharding_estimate`, fake tensors and a
fake process group). :func:`sharded_workload` derives, from any :class:`ledgerspec.derivations.workload.Workload`
class, one whose ``prepare`` also applies ``fully_shard`` to every decoder layer (the no-split classes, as
:mod:`ledgerspec.derivations.sharding_model` finds them) and then to the root, on the meta device, and whose
materialisation allocates only this rank's padded shard of every parameter, laid out as
``FSDPParam._init_sharded_param`` does: a ``ceil(d0 / W)``-row padded storage, the parameter a DTensor over
its first ``rows`` rows. Frozen shards come at ``after_load``, trainable ones at ``after_adapter_injection``;
buffers are replicated (every rank holds them whole). A process group must be initialised before ``prepare``.
Imports torch only inside functions.
"""

from __future__ import annotations

from functools import cache
from typing import Any


def fsdp_params(model: Any) -> list[Any]:
    """Every ``FSDPParam`` of every ``fully_shard``-ed module of ``model``."""
    out: list[Any] = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            out.extend(group.fsdp_params)
    return out


@cache
def sharded_workload(base: type) -> Any:
    """A subclass of the workload class ``base`` that is sharded with FSDP2 (set ``reshard_after_forward``)."""
    import torch
    from torch import nn

    class Sharded(base):
        #: fully_shard's reshard_after_forward; None: FSDP2's default (layers reshard, the root does not)
        reshard_after_forward: bool | None = None

        def prepare(self) -> None:
            if self.model is not None:
                return
            from torch.distributed.fsdp import fully_shard

            from ledgerspec.derivations.sharding_model import decoder_layers

            super().prepare()
            model: Any = self.model
            for layer in decoder_layers(model):
                fully_shard(layer, reshard_after_forward=self.reshard_after_forward)
            fully_shard(model, reshard_after_forward=self.reshard_after_forward)

        def _materialise(self, device: Any, adapters: bool) -> None:
            self._materialise_shards(device, adapters)
            super()._materialise(device, adapters)  # the replicated buffers; every parameter is done already

        def _materialise_shards(self, device: Any, adapters: bool) -> None:
            for fp in fsdp_params(self.model):
                param = fp.sharded_param
                if bool(param.requires_grad) != adapters or not param._local_tensor.is_meta:
                    continue
                padded = torch.empty(fp.padded_sharded_param_size, dtype=param.dtype, device=device)
                with torch.no_grad():
                    if padded.is_floating_point():
                        padded.normal_(0.0, 0.02)
                    else:
                        padded.zero_()
                fp._sharded_param_data = padded.view(-1)
                rows = fp.sharded_size[0] if len(fp.sharded_size) else 0
                local = padded.narrow(0, 0, rows)
                fp.sharded_param = nn.Parameter(fp.to_sharded_dtensor(local), requires_grad=param.requires_grad)
                fp._setattr_on_modules(fp.sharded_param)

    Sharded.__name__ = Sharded.__qualname__ = f"Sharded{base.__name__}"
    return Sharded


__all__ = ["fsdp_params", "sharded_workload"]
