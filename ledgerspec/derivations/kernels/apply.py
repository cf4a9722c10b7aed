"""The declared kernels (``software.kernels``) put in place of transformers' modules for one simulation.

What each tool does to the model, done to the simulated one with the allocation models of
:mod:`ledgerspec.derivations.kernels.liger` and :mod:`ledgerspec.derivations.kernels.cce`:

- a fused linear cross-entropy (and TRL's fused LM head, :mod:`.trl`): Liger's ``lce_forward`` (liger-kernel 0.8.5,
  ``transformers/model/llama.py:113-115``)
  and the CCE fork's ``cce_forward`` skip the ``lm_head`` when training with labels and return ``logits=None``;
  here the model's own forward runs with its ``lm_head`` passing the hidden states through and its loss function
  replaced by the fused kernel on ``lm_head.weight``, and the returned logits dropped;
- ``liger_rms_norm``: every ``*RMSNorm`` module's forward rebound (``_patch_rms_norm_module``: ``in_place=True``,
  llama casting; Gemma's norms ``in_place=False``);
- ``liger_swiglu`` / ``liger_geglu``: every gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``)
  computes ``down_proj(act_mul(gate_proj(x), up_proj(x)))`` (``LigerSwiGLUMLP.forward``, ``transformers/swiglu.py``);
  the projections stay PEFT's LoRA layers, as under Liger's instance patching;
- ``liger_rope``: the modeling module's ``apply_rotary_pos_emb`` replaced (``monkey_patch.py``).

Kernels the catalogue marks as not modelled are left to transformers' modules (rule LS013 says so).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

from ledgerspec.contract.config import Kernels
from ledgerspec.contract.kernels import LIGER_MODEL_TYPES, is_modelled

#: streaming multiprocessors of the GPU Liger's RMSNorm sums weight gradients over (an H100/H200's 132); only a
#: norm weight that trains (full fine-tuning) allocates by it, or every norm's under liger-kernel 0.4.0-0.8.4
SM_COUNT = 132


def modelled(kernels: Kernels, model_type: str | None = None) -> tuple[tuple[str, str], ...]:
    """The declared (op, kernel) pairs the simulation puts in place; Liger's only on the model types it patches
    (``model_type`` None: not known yet, every declared one)."""
    return tuple(
        (op, k)
        for op, k in kernels.declared()
        if is_modelled(op, k)
        and not (model_type is not None and k.startswith("liger_") and not liger_patches(model_type))
    )


def liger_patches(model_type: str) -> bool:
    """Whether Liger applies its kernels to a model of this type (it applies nothing to the others)."""
    return model_type in LIGER_MODEL_TYPES


def unpatched_note(kernels: Kernels, model_type: str | None) -> str | None:
    """The method text's note on declared Liger kernels that Liger does not apply to this model type."""
    if model_type is None or liger_patches(model_type):
        return None
    names = [k for _, k in kernels.declared() if k.startswith("liger_")]
    if not names:
        return None
    return (
        f"declared {', '.join(names)} not applied: Liger patches no {model_type} model (MODEL_TYPE_TO_APPLY_LIGER_FN), "
        "so the step runs transformers' modules there"
    )


def method_note(kernels: Kernels) -> str | None:
    """What the method text says of the declared kernels (and of a declared liger-kernel release)."""
    from ledgerspec.derivations.kernels import liger

    done = modelled(kernels)
    if not done:
        return None
    names = ", ".join(k for _, k in done)
    note = f"declared kernels modelled (allocation models of their sources): {names}"
    version = liger.version_note(kernels.packages) if any(k.startswith("liger_") for _, k in done) else None
    return note if version is None else f"{note}; {version}"


@contextlib.contextmanager
def simulated_kernels(model: Any, kernels: Kernels, autocast_dtype: str | None, on_cuda: bool) -> Iterator[None]:
    """While inside, the model runs the declared kernels that are modelled (see the module docstring)."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(base.config, "model_type", None)
    done = modelled(kernels, model_type)
    pairs = dict(done)  # one kernel per op, but lora_projections may hold several: read from `done` below
    if not pairs:
        yield
        return
    from ledgerspec.derivations.engine import cuda_reduce
    from ledgerspec.derivations.kernels import liger

    amp = getattr(torch, autocast_dtype) if autocast_dtype else None
    release = liger.declared_release(kernels.packages)
    device = cuda_reduce.CudaDevice(SM_COUNT) if on_cuda else None
    with contextlib.ExitStack() as stack:
        # TRL's head off CUDA: the step runs TRL's own code (engine/trl_sft.py), not a modelled loss
        if "cross_entropy" in pairs and (on_cuda or pairs["cross_entropy"] != "trl_chunked_nll"):
            stack.enter_context(_fused_loss(base, pairs["cross_entropy"], amp, on_cuda, release))
        if "norm" in pairs:
            stack.enter_context(_norms(base, release, device))
        if "mlp_activation" in pairs:
            stack.enter_context(_mlps(base))
        if "rope" in pairs:
            stack.enter_context(_rope(base))
        lora = [k for op, k in done if op == "lora_projections"]
        if lora:
            stack.enter_context(_axolotl_lora(base, lora))
        yield


def _rebind(stack: contextlib.ExitStack, module: Any, forward: Any) -> None:
    """Set ``module.forward`` on the instance (as Liger's instance patching does) until the stack closes."""
    had = "forward" in module.__dict__
    saved = module.__dict__.get("forward")
    module.forward = types.MethodType(forward, module)

    def restore() -> None:
        if had:
            module.forward = saved
        else:
            del module.forward

    stack.callback(restore)


@contextlib.contextmanager
def _fused_loss(base: Any, name: str, amp: Any, on_cuda: bool, release: tuple[int, int, int]) -> Iterator[None]:
    from ledgerspec.derivations.kernels import cce, liger, trl

    head = base.get_output_embeddings()

    def loss_function(logits: Any, labels: Any, vocab_size: int = 0, num_items_in_batch: Any = None, **kw: Any) -> Any:
        hidden = logits  # the lm_head passed the hidden states through
        # looked up at each call, as the tools do: FSDP swaps in the gathered parameter during forward
        weight = base.get_output_embeddings().weight
        if name == "trl_chunked_nll":
            return trl.functions().chunked_nll_loss(hidden, weight, labels, num_items_in_batch, amp)
        if name == "cut_cross_entropy":
            return cce.functions().linear_cross_entropy_loss(hidden, weight, labels, num_items_in_batch)
        return liger.functions().fused_linear_cross_entropy_loss(
            hidden, weight, labels, num_items_in_batch, on_cuda, amp, release
        )

    def passthrough(self: Any, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        return hidden

    original = base.forward

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if kwargs.get("labels") is not None and self.training:
            out["logits"] = None  # lce_forward / cce_forward return no logits when they skip them
        return out

    had_loss = "_loss_function" in base.__dict__
    saved_loss = base.__dict__.get("_loss_function")
    text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    softcap = getattr(text, "final_logit_softcapping", None)
    with contextlib.ExitStack() as stack:
        _rebind(stack, head, passthrough)
        _rebind(stack, base, forward)
        base._loss_function = loss_function
        if softcap is not None:  # the kernels cap the logits inside (Liger passes softcap in): not the hidden states
            text.final_logit_softcapping = None
        try:
            yield
        finally:
            if softcap is not None:
                text.final_logit_softcapping = softcap
            if had_loss:
                base._loss_function = saved_loss
            else:
                del base._loss_function


@contextlib.contextmanager
def _norms(base: Any, release: tuple[int, int, int], device: Any) -> Iterator[None]:
    """``device``: the CUDA device whose reduction staging the weight-gradient sums take (None: not CUDA)."""
    from ledgerspec.derivations.kernels import liger

    RMSNorm = liger.functions().RMSNorm

    def forward(self: Any, hidden: Any) -> Any:
        # Liger rebinds Gemma 2/3 norms with in_place=False (their residual reads the input again), others in place;
        # every Gemma norm with casting_mode="gemma" (monkey_patch.py, _patch_rms_norm_module)
        name = type(self).__name__
        in_place = not name.startswith(("Gemma2", "Gemma3"))
        return RMSNorm.apply(hidden, self.weight, in_place, SM_COUNT, release, name.startswith("Gemma"), device)

    with contextlib.ExitStack() as stack:
        for module in base.modules():
            if type(module).__name__.endswith("RMSNorm") and getattr(module, "weight", None) is not None:
                _rebind(stack, module, forward)
        yield


@contextlib.contextmanager
def _mlps(base: Any) -> Iterator[None]:
    from ledgerspec.derivations.kernels import liger

    GatedActivation = liger.functions().GatedActivation

    def forward(self: Any, x: Any) -> Any:
        return self.down_proj(GatedActivation.apply(self.gate_proj(x), self.up_proj(x)))

    with contextlib.ExitStack() as stack:
        for module in base.modules():
            if all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
                _rebind(stack, module, forward)
        yield


def _lora_parts(proj: Any) -> tuple[Any, Any, Any, float, Any] | None:
    """``get_lora_parameters`` (axolotl kernels/lora.py:110-199): base layer, A, B, scale and dropout of a PEFT LoRA
    layer with one active adapter; None for a layer without LoRA."""
    if not hasattr(proj, "lora_A") or not hasattr(proj, "base_layer"):
        return None
    names = [n for n in proj.active_adapters if n in proj.lora_A]
    if len(names) != 1:
        return None
    n = names[0]
    return proj.base_layer, proj.lora_A[n].weight, proj.lora_B[n].weight, float(proj.scaling[n]), proj.lora_dropout[n]


def _dropped(drop: Any, x: Any, training: bool) -> Any:
    """``_apply_dropout``: the dropped-out input, or None for ``nn.Identity`` or in eval."""
    import torch

    if drop is None or isinstance(drop, torch.nn.Identity) or not training:
        return None
    return drop(x)


@contextlib.contextmanager
def _axolotl_lora(base: Any, ids: list[str]) -> Iterator[None]:
    """axolotl's ``apply_lora_kernel_patches`` (monkeypatch/lora_kernels.py): the fused function where every
    projection of its group carries LoRA. The attention calls q, k, v in turn with one input: q's forward runs the
    fused function and hands k and v their outputs."""
    from ledgerspec.derivations.kernels import axolotl

    LoRA_MLP = axolotl.functions().LoRA_MLP
    LoRA_O = axolotl.functions().LoRA_O
    LoRA_QKV = axolotl.functions().LoRA_QKV

    def qkv_forward(self: Any, x: Any) -> Any:
        parts = [_lora_parts(p) for p in self._ls_qkv]
        x_drop = _dropped(parts[0][4], x, self.training)  # type: ignore[index]
        ab = [t for p in parts for t in (p[1], p[2])]  # type: ignore[index]
        layers = tuple((p[0], p[3]) for p in parts)  # type: ignore[index]
        q, k, v = LoRA_QKV.apply(x, x_drop, *ab, layers)
        self._ls_qkv[1]._ls_out, self._ls_qkv[2]._ls_out = k, v
        return q

    def handed(self: Any, x: Any) -> Any:
        out, self._ls_out = self._ls_out, None
        return out

    def o_forward(self: Any, x: Any) -> Any:
        b, a, bb, s, drop = _lora_parts(self)  # type: ignore[misc]
        return LoRA_O.apply(x, _dropped(drop, x, self.training), b, a, bb, s)

    def mlp_forward(self: Any, x: Any) -> Any:
        parts = [_lora_parts(p) for p in (self.gate_proj, self.up_proj, self.down_proj)]
        x_drop = _dropped(parts[0][4], x, self.training)  # type: ignore[index]
        ab = [t for p in parts for t in (p[1], p[2])]  # type: ignore[index]
        return LoRA_MLP.apply(x, x_drop, *ab, tuple((p[0], p[3]) for p in parts))  # type: ignore[index]

    with contextlib.ExitStack() as stack:
        for module in base.modules():
            qkv = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj")]
            if "axolotl_lora_qkv" in ids and all(p is not None and _lora_parts(p) for p in qkv):
                qkv[0]._ls_qkv = qkv  # type: ignore[union-attr]
                stack.callback(delattr, qkv[0], "_ls_qkv")
                _rebind(stack, qkv[0], qkv_forward)
                _rebind(stack, qkv[1], handed)
                _rebind(stack, qkv[2], handed)
                for proj in qkv[1:]:
                    proj._ls_out = None  # type: ignore[union-attr]
                    stack.callback(delattr, proj, "_ls_out")
            o = getattr(module, "o_proj", None)
            if "axolotl_lora_o" in ids and o is not None and _lora_parts(o):
                _rebind(stack, o, o_forward)
            mlp = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
            if "axolotl_lora_mlp" in ids and all(p is not None and _lora_parts(p) for p in mlp):
                _rebind(stack, module, mlp_forward)
        yield


@contextlib.contextmanager
def _rope(base: Any) -> Iterator[None]:
    from ledgerspec.derivations.kernels import liger

    rotary_pos_emb = liger.functions().rotary_pos_emb

    modeling = sys.modules[type(base).__module__]
    saved = getattr(modeling, "apply_rotary_pos_emb", None)
    if saved is None:
        yield
        return
    modeling.apply_rotary_pos_emb = rotary_pos_emb  # type: ignore[attr-defined]
    try:
        yield
    finally:
        modeling.apply_rotary_pos_emb = saved  # type: ignore[attr-defined]


__all__ = ["SM_COUNT", "liger_patches", "method_note", "modelled", "simulated_kernels", "unpatched_note"]
