"""The truth for the MoE layout of transformers < 5: a real ``transformers.Trainer`` QLoRA step of a tiny MoE model
(Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, gpt-oss, or a dense twin) with transformers 4.48.1 (per-expert
``nn.Linear`` experts ``w1``/``w2``/``w3`` that bitsandbytes quantizes, and 4.48.1's routing loop) or 4.57.6, read from
the outside by ``tests/truths/trainer_run.py`` (the same program as the installed stack's Trainer truths), plus the
number of tokens each expert of each MoE block received in each call (the routing of the real run, which the simulation
takes as given: tests/derivations/stack/test_legacy_moe.py).

Needs a venv of the old stack, NOT the project's (never install into it)::

    python3.11 -m venv /tmp/venv-moe
    /tmp/venv-moe/bin/pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl  # torch 2.13 CPU
    /tmp/venv-moe/bin/pip install transformers==4.48.1 peft==0.14.0 accelerate==1.3.0 bitsandbytes==0.50.2 \
        ruamel.yaml jsonschema referencing
    PYTHONPATH=. /tmp/venv-moe/bin/python benchmarks/legacy_moe_truth.py tests/data/legacy_moe/CASE.case.json \
        tests/data/legacy_moe/CASE.truth.json

Qwen3-MoE (transformers >= 4.51), DeepSeek-V2 (>= 4.54), DeepSeek-V3 (>= 4.51) and gpt-oss (>= 4.55) ran in a second
venv made the same way with transformers==4.57.6 peft==0.17.1 accelerate==1.10.1 (``/tmp/venv-moe457``); each truth
file records its stack and command. Their routing is read from the router (DeepSeek's ``gate``, gpt-oss's
``router``), whose output carries the chosen experts. A step that fails (DeepSeek-V3 under PEFT's k-bit preparation)
is recorded with its error's first line instead of its figures (``"error"``).

Three shims, none allocates nor changes a step: transformers 4.48.1's bitsandbytes environment check
(``integrations/bitsandbytes.py``, ``validate_bnb_backend_availability``) demands CUDA unless bitsandbytes reports a
"multi_backend" feature, which 0.50.2 (whose CPU backend is built in) no longer reports, so the check is answered yes;
trainer_run.py's ``dtype=`` keyword (transformers 5) is passed as 4.48's ``torch_dtype=``; and the phase reader's
``trainer._tr_loss`` (transformers 5's running loss) is an empty tensor (4.48.1 keeps a local ``tr_loss`` instead).
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _shims() -> None:
    import transformers
    import transformers.integrations as integrations
    import transformers.integrations.bitsandbytes as bnb_integration

    if hasattr(bnb_integration, "validate_bnb_backend_availability"):
        integrations.validate_bnb_backend_availability = lambda raise_exception=False: True  # type: ignore[attr-defined]
        bnb_integration.validate_bnb_backend_availability = lambda raise_exception=False: True

    import torch

    # trainer_run.py's phase reader tracks transformers 5's ``Trainer._tr_loss`` (the running loss, made before the
    # tracker starts); 4.48.1 keeps it in a local ``tr_loss`` of ``_inner_training_loop`` instead: an empty stand-in
    if not hasattr(transformers.Trainer, "_tr_loss"):
        transformers.Trainer._tr_loss = torch.empty(0)  # type: ignore[attr-defined]
    auto = transformers.AutoModelForCausalLM
    from_config, from_pretrained = auto.from_config.__func__, auto.from_pretrained.__func__  # type: ignore[attr-defined]

    def renamed(kw: dict) -> dict:  # type: ignore[type-arg]
        if "dtype" in kw:
            kw["torch_dtype"] = kw.pop("dtype")
        return kw

    auto.from_config = classmethod(lambda cls, *a, **kw: from_config(cls, *a, **renamed(kw)))  # type: ignore[assignment]
    auto.from_pretrained = classmethod(lambda cls, *a, **kw: from_pretrained(cls, *a, **renamed(kw)))  # type: ignore[assignment]


def _record_routing(calls: list[dict[str, object]]) -> None:
    """A forward hook on every MoE block (Mixtral's, Qwen2-MoE's): the tokens each expert got (from the block's router
    logits, 4.48.1's softmax + top-k), computed with the tracker's dispatch mode off (nothing it counts)."""
    import importlib

    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    for family, name in (
        ("mixtral", "MixtralSparseMoeBlock"),
        ("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
        ("qwen3_moe", "Qwen3MoeSparseMoeBlock"),  # transformers >= 4.51
    ):
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        _hook_init(getattr(module, name), lambda module, args, output: hook(module, args, output))

    # DeepSeek-V2/V3 (transformers 4.51-4.57.6): the block returns its output only; the router (``gate``) returns the
    # chosen experts first (``DeepseekV3TopkRouter``: ``topk_indices, topk_weights``; ``DeepseekV2MoEGate``:
    # ``topk_idx, topk_weight``), counted as they are
    # gpt-oss (4.55-4.57.6): its router returns ``router_scores, router_indices``
    for family, name, experts, at in (
        ("deepseek_v3", "DeepseekV3TopkRouter", "n_routed_experts", 0),
        ("deepseek_v2", "DeepseekV2MoEGate", "num_experts", 0),
        ("gpt_oss", "GptOssTopKRouter", "num_experts", 1),
    ):
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        _hook_init(getattr(module, name), lambda module, args, output, e=experts, i=at: chosen(module, output[i], e))

    def chosen(module, indices, experts):  # type: ignore[no-untyped-def]
        with _disable_current_modes(), torch.no_grad():
            counts = torch.bincount(indices.flatten(), minlength=getattr(module, experts)).tolist()
            calls.append({"tokens": int(indices.shape[0]), "counts": [int(c) for c in counts]})

    def hook(module, args, output):  # type: ignore[no-untyped-def]
        with _disable_current_modes(), torch.no_grad():
            logits = output[1].detach().float()
            chosen = torch.topk(torch.softmax(logits, dim=1), module.top_k, dim=-1).indices
            counts = torch.bincount(chosen.flatten(), minlength=module.num_experts).tolist()
            calls.append({"tokens": int(logits.shape[0]), "counts": [int(c) for c in counts]})


def _hook_init(cls, hook) -> None:  # type: ignore[no-untyped-def]
    original = cls.__init__

    def init(self, config, *a, **kw):  # type: ignore[no-untyped-def]
        original(self, config, *a, **kw)
        self.register_forward_hook(hook)

    cls.__init__ = init


def main() -> int:
    case_path, out_path = sys.argv[1], sys.argv[2]
    _shims()
    calls: list[dict[str, object]] = []
    _record_routing(calls)
    from tests.truths import trainer_run

    with open(case_path, encoding="utf-8") as fh:
        case = json.load(fh)
    if not os.path.isabs(case["config"]):
        case["config"] = os.path.join(os.path.dirname(HERE), case["config"])
    try:
        out = trainer_run.run(case)
    except RuntimeError as exc:  # the declared step cannot run: its error is the truth (the first line)
        out = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    import accelerate
    import bitsandbytes
    import peft
    import torch
    import transformers

    out["stack"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "accelerate": accelerate.__version__,
        "bitsandbytes": bitsandbytes.__version__,
    }
    out["routing"] = calls
    venv = "/tmp/venv-moe" if transformers.__version__ == "4.48.1" else "/tmp/venv-moe457"
    out["command"] = f"PYTHONPATH=. {venv}/bin/python benchmarks/legacy_moe_truth.py " + " ".join(sys.argv[1:])
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")
    print(json.dumps(out.get("phases") or out["error"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
