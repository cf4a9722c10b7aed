"""The training step as the declared loop runs it, micro-step by micro-step (``training.loop``).

:class:`TrainerLoop` is ``transformers.Trainer`` 5.x as its source runs one optimizer step (TRL's trainers
subclass it and keep this loop), read in ``trainer.py`` (``_inner_training_loop``, ``get_batch_samples``,
``training_step``, ``compute_loss``, ``_clip_grad_norm``) and accelerate 1.x (``Accelerator.prepare_model``,
``backward``, ``clip_grad_norm_``, ``utils.operations.convert_outputs_to_fp32``):

1. the step's micro-batches are fetched together and stay on the device until the next step's replace them
   (``get_batch_samples``; accelerate's prepared dataloader yields them on the device), with
   ``num_items_in_batch``, the count of label tokens (a tensor, divided by the tp x cp x sp size);
2. each micro-step: ``outputs = model(**inputs, num_items_in_batch=...)``: the loss is computed inside the
   model's forward from ``labels`` (a sum over tokens divided by ``num_items_in_batch``); under mixed precision
   the forward runs in ``torch.autocast`` and the outputs are converted to fp32 after it (a fp32 copy of the
   logits); ``compute_loss`` returns only the loss, so the outputs are released before backward; the loss is not
   divided again (the model took ``num_items_in_batch``); ``accelerator.backward`` divides it by the
   accelerator's (unit) accumulation steps and, with fp16, scales it with a ``GradScaler``; the detached loss is
   checked for nan/inf and added to the running ``tr_loss``;
3. after the last micro-step: ``clip_grad_norm_`` (unscaling first with fp16) when ``max_grad_norm > 0``, the
   optimizer step (through the scaler with fp16, then ``scaler.update()``), ``model.zero_grad()``.

:class:`CustomLoop` is a hand-written loop that keeps the logits through backward: ``logits = model(ids).logits``,
the model's own causal-LM loss on them, divided by the accumulation steps, ``backward``, then the logits go.

Both run on real tensors (``measure``) and on fake ones (``estimate``); the memory of each op is what the tracker
or the allocator sees, nothing here is a formula.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ledgerspec.derivations.engine.autocast import autocast_region


def convert_to_fp32(outputs: Any) -> Any:
    """accelerate's ``convert_to_fp32``: every fp16/bf16 tensor of a (nested) output converted with ``.float()``."""
    import torch

    if isinstance(outputs, torch.Tensor):
        return outputs.float() if outputs.dtype in (torch.float16, torch.bfloat16) else outputs
    if isinstance(outputs, dict):  # ModelOutput is an OrderedDict; recursively_apply keeps its type
        converted = type(outputs)(**{k: convert_to_fp32(v) for k, v in outputs.items()})
        return converted
    if isinstance(outputs, list | tuple):
        return type(outputs)(convert_to_fp32(o) for o in outputs)
    return outputs


class TrainingStep:
    """One optimizer step of the declared loop over a :class:`~ledgerspec.derivations.engine.workload.Workload`.

    The protocol calls :meth:`start` once per optimizer step, then per micro-step :meth:`forward`, :meth:`loss`,
    :meth:`backward`, :meth:`release`, then :meth:`optimizer_step` and :meth:`zero_grad`.
    """

    name = "abstract"

    def __init__(self, workload: Any) -> None:
        self.w = workload
        self.scaler: Any = None

    @property
    def spec(self) -> Any:
        return self.w.spec

    def autocast(self) -> Any:
        return autocast_region(self.spec.autocast_dtype, "cpu" if self.w.device_type == "cpu" else "cuda")

    def start(self, seq: int, micro_steps: int) -> None:
        raise NotImplementedError

    def forward(self, i: int) -> Any:
        raise NotImplementedError

    def loss(self, out: Any, i: int) -> Any:
        raise NotImplementedError

    def backward(self, loss: Any) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def release(self, i: int) -> None:
        """Drop what the loop holds of micro-step ``i`` once its backward is done."""

    def optimizer_step(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        self.w.optimizer.zero_grad(set_to_none=True)

    def finish(self) -> None:
        """The end of training: drop everything the loop still holds."""


class CustomLoop(TrainingStep):
    """A loop that keeps the outputs (the logits) through backward. With ``training.loss_item_each_step`` it reads
    its loss on the host after each backward (``loss.item()``, as Answer.AI's ``fsdp_qlora`` train.py does): under
    FSDP the host waits for the device there (:func:`ledgerspec.derivations.shard.simulation.device_waits`)."""

    name = "custom"

    def __init__(self, workload: Any) -> None:
        super().__init__(workload)
        self.seq = 0
        self.batch: tuple[Any, Any] | None = None

    def start(self, seq: int, micro_steps: int) -> None:
        self.seq = seq
        if self.spec.autocast_dtype == "float16" and self.scaler is None:
            self.scaler = self.w.grad_scaler()

    def forward(self, i: int) -> Any:
        inputs, labels = self.w.batch(self.seq)
        self.batch = (inputs, labels)
        with self.autocast():
            if isinstance(inputs, dict):
                out = self.w.model(**self.w.model_inputs(inputs), **self.w.cache_kwargs())
            else:
                out = self.w.model(input_ids=inputs, **self.w.cache_kwargs())
            return out.logits

    def loss(self, logits: Any, i: int) -> Any:
        """transformers' causal-LM loss on the kept logits, divided by the accumulation steps."""
        assert self.batch is not None
        labels = self.batch[1]
        base = self.w.model.get_base_model()
        vocab = int(base.config.get_text_config().vocab_size)
        fn = getattr(base, "loss_function", None)
        with self.autocast():
            if fn is None:
                import torch.nn.functional as nnf

                shift = logits[..., :-1, :].float().reshape(-1, vocab)
                loss = nnf.cross_entropy(shift, labels[..., 1:].reshape(-1))
            else:
                loss = fn(logits=logits, labels=labels, vocab_size=vocab)
        if self.spec.accumulation > 1:
            loss = loss / self.spec.accumulation
        return loss

    def release(self, i: int) -> None:
        self.batch = None

    def optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.w.optimizer)
            self.scaler.update()
        else:
            self.w.optimizer.step()

    def finish(self) -> None:
        self.batch = None


class TrainerLoop(TrainingStep):
    """``transformers.Trainer``'s step (see the module docstring for the source it follows)."""

    name = "trainer"

    def __init__(self, workload: Any) -> None:
        super().__init__(workload)
        self.batches: list[dict[str, Any]] = []
        self.num_items: Any = None
        self.tr_loss: Any = None
        self.step_loss: Any = None  # `tr_loss_step`, held until the next micro-step's replaces it
        self.grad_norm: Any = None  # the clipping's total norm, held until the next step's (`_get_grad_norm`)

    def start(self, seq: int, micro_steps: int) -> None:
        import torch

        if self.tr_loss is None:  # _inner_training_loop: `self._tr_loss = torch.tensor(0.0, device=args.device)`
            self.tr_loss = torch.tensor(0.0, device=self.w.device)
            if self.spec.autocast_dtype == "float16":
                self.scaler = self.w.grad_scaler()
        # get_batch_samples: the new micro-batches exist before the old list is dropped
        self.batches, self.num_items = self.fetch(seq, micro_steps)

    def fetch(self, seq: int, micro_steps: int) -> tuple[list[dict[str, Any]], Any]:
        """``get_batch_samples``: the step's micro-batches and ``num_items_in_batch`` (the label tokens)."""
        batches = [self.w.trainer_batch(seq) for _ in range(micro_steps)]
        num_items = sum(b["labels"][..., 1:].ne(-100).sum() for b in batches)
        return batches, num_items.to(self.w.device) / 1  # `/ (tp * cp * sp size)`

    def call(self, inputs: dict[str, Any], **extra: Any) -> Any:
        """The model called as the prepared model is: in the autocast region, its outputs converted to fp32 after it
        under mixed precision (accelerate's ConvertOutputsToFp32)."""
        with self.autocast():
            outputs = self.w.model(**inputs, **extra)
        return convert_to_fp32(outputs) if self.spec.autocast_dtype is not None else outputs

    def forward(self, i: int) -> Any:
        inputs = self.w.model_inputs(self.batches[i])
        outputs = self.call(inputs, **self.w.cache_kwargs(), num_items_in_batch=self.num_items)
        loss = outputs["loss"]
        del outputs  # compute_loss returns the loss only
        return loss

    def loss(self, out: Any, i: int) -> Any:
        # training_step: the loss was normalised by num_items_in_batch inside the model (loss_is_scaled_for_ga),
        # so the Trainer does not divide it by the accumulation steps
        return out

    def backward(self, loss: Any) -> None:
        import torch
        from torch._subclasses.fake_tensor import is_fake

        # accelerator.backward: `loss = loss / self.gradient_accumulation_steps` (1: the Trainer does not use
        # accelerate's accumulation), then the scaler or a plain backward
        self.accelerator_backward(loss / 1)
        step_loss = loss.detach()  # training_step returns `loss.detach()`
        # logging_nan_inf_filter (default on): `torch.isnan(x) or torch.isinf(x)`, one bool tensor at a time
        check = torch.isnan(step_loss)
        if is_fake(check) or not bool(check):
            del check
            check = torch.isinf(step_loss)
        del check
        self.tr_loss += step_loss
        self.step_loss = step_loss

    def accelerator_backward(self, loss: Any) -> None:
        """What ``accelerator.backward`` runs on the scaled loss (a DeepSpeed engine replaces it)."""
        super().backward(loss)

    def optimizer_step(self) -> None:
        import torch

        opt = self.w.optimizer
        # `grad_norm = None; if max_grad_norm > 0: grad_norm = self._clip_grad_norm(model)`, then `_get_grad_norm`
        # computes it anyway without clipping (norm inf); accelerator.clip_grad_norm_ unscales fp16 gradients first
        self.grad_norm = None
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        norm = self.spec.max_grad_norm if self.spec.max_grad_norm > 0 else float("inf")
        self.grad_norm = torch.nn.utils.clip_grad_norm_(list(self.w.model.parameters()), norm)
        if self.scaler is not None:
            self.scaler.step(opt)
            self.scaler.update()
        else:
            opt.step()

    def zero_grad(self) -> None:
        self.w.model.zero_grad()  # Trainer: model.zero_grad() (set_to_none=True)

    def finish(self) -> None:
        self.batches, self.num_items, self.grad_norm, self.step_loss = [], None, None, None


@contextlib.contextmanager
def no_autocast() -> Any:
    """A region that runs as one fused kernel would: no autocast inside (the attention models use it)."""
    import torch

    with torch.autocast("cpu", enabled=False):
        yield


__all__ = ["CustomLoop", "TrainerLoop", "TrainingStep", "convert_to_fp32", "no_autocast"]
