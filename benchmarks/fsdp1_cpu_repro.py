"""The published FSDP1 step (transformers 4.48.1 Trainer + accelerate 1.0.1 + PEFT 0.13.2, torch 2.4.1) run for real on
the CPU with 2 ranks on gloo, rank 0's live tensor bytes measured per phase, and the tensors alive at its peak listed.

Needs the published stack's venv (/work/venv448: torch 2.4.1, transformers 4.48.1, accelerate 1.0.1, peft 0.13.2,
trl 0.13.0; see benchmarks/results/published-multi-gpu-cpu-repro.md), NOT the project's venv:

    /work/venv448/bin/torchrun --nproc_per_node 2 benchmarks/fsdp1_cpu_repro.py --seqs 2 --length 512 [--bf16] \
        [--config tiny-mistral-deep] [--out benchmarks/results/fsdp1-cpu-repro/NAME.json]
    /work/venv448/bin/python benchmarks/fsdp1_cpu_repro.py --single --seqs 2 --length 512 [--bf16]

NAME is the ledger's in benchmarks/published-multi-gpu-cpu-repro/ that states the same run (what
benchmarks/fsdp1_cpu_repro_compare.py simulates beside it).

Prints one JSON line (rank 0): the peak of live tensor bytes per phase (setup = everything in ``train()`` before the
first forward, i.e. accelerate's FSDP wrapping; forward; backward; optimizer) and the largest storages alive at the
overall peak with the phase and the Python line that allocated them.

accelerate 1.0.1 does not turn FSDP on for a CPU run: ``accelerate/state.py`` lines 906-914 switch ``distributed_type``
to FSDP only for MULTI_GPU/MLU/MUSA/NPU/XPU, and a CPU run with several processes is MULTI_CPU. :func:`allow_cpu_fsdp`
repeats those three lines for MULTI_CPU (nothing else is changed): the Trainer then wraps the model with accelerate's
own ``prepare_model`` FSDP branch (``accelerator.py`` 1.0.1 lines 1483-1580), as on the GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
import weakref

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def allow_cpu_fsdp() -> None:
    """accelerate 1.0.1 state.py 906-914 for a MULTI_CPU run (the one check that refuses FSDP on the CPU)."""
    from accelerate import state as st
    from accelerate.utils import DistributedType

    orig = st.AcceleratorState.__init__

    def init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        orig(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if self.distributed_type == DistributedType.MULTI_CPU and plugin is not None:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = plugin
            # every later AcceleratorState() re-reads PartialState's distributed_type (state.py 862): keep it FSDP
            st.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    st.AcceleratorState.__init__ = init

    # torch 2.4.1 FSDP1 on the CPU: accelerate passes its device (cpu, index 0) as device_id, FSDP takes it as the
    # compute device (torch/distributed/fsdp/_init_utils.py 1044-1046) and then asserts that tensors on "cpu" are on
    # "cpu:0" (_runtime_utils.py 143-158, utils._p_assert): the compute device is normalised to plain "cpu"
    from torch.distributed.fsdp import _init_utils as iu

    orig_compute = iu._get_compute_device

    def compute_device(*c_args, **c_kwargs):  # type: ignore[no-untyped-def]
        dev = orig_compute(*c_args, **c_kwargs)
        return torch.device("cpu") if dev.type == "cpu" else dev

    iu._get_compute_device = compute_device


class Tracker:
    """Live CPU tensor bytes (unique storages), per phase peak, and the storages alive at the overall peak.

    The bytes of a storage are read at every op, not only when it is made: FSDP1 frees and re-allocates its unsharded
    flat parameters by resizing their storages (``_free_storage``/``_alloc_storage``, a ``resize_`` that no dispatched
    op shows), so a storage's size at creation is not its size later.
    """

    def __init__(self) -> None:
        self.live: dict[int, tuple[object, str, str, str]] = {}  # key -> (weakref to storage, phase, desc, where)
        self.cur = 0
        self.phase = "before"
        self.peaks: dict[str, int] = {}
        self.peak = 0
        self.at_peak: list[tuple[int, str, str, str]] = []
        self.peak_phase = ""

    def add(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        key = s._cdata
        if key not in self.live and s.device.type == "cpu":
            where = ""
            if s.nbytes() >= 1 << 16:
                frames = [
                    f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}"
                    for f in traceback.extract_stack()[:-3]
                    if "fsdp1_cpu_repro" not in f.filename
                    and "/torch/utils/_" not in f.filename
                    and "/torch/nn/modules/module.py" not in f.filename
                ]
                where = " <- ".join(reversed(frames[-8:]))
            desc = f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
            self.live[key] = (weakref.ref(s), self.phase, desc, where)
            weakref.finalize(s, self.live.pop, key, None)
        self.sample()

    def sizes(self) -> list[tuple[int, str, str, str]]:
        out = []
        for ref, phase, desc, where in list(self.live.values()):
            s = ref()  # type: ignore[operator]
            if s is not None:
                out.append((s.nbytes(), phase, desc, where))
        return out

    def sample(self) -> None:
        sizes = self.sizes()
        self.cur = sum(n for n, *_ in sizes)
        if self.cur > self.peaks.get(self.phase, 0):
            self.peaks[self.phase] = self.cur
        if self.cur > self.peak:
            self.peak = self.cur
            self.peak_phase = self.phase
            self.at_peak = sizes

    def set_phase(self, phase: str) -> None:
        self.sample()
        self.phase = phase
        self.sample()


def at_peak_groups(items: list[tuple[int, str, str, str]]) -> list[dict[str, object]]:
    """The storages alive at the peak, grouped by (phase made in, shape and dtype, allocating lines), largest first."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for n, phase, desc, where in items:
        if n:
            g = groups.setdefault((phase, desc, where), [0, 0])
            g[0] += 1
            g[1] += n
    rows = [
        {"count": c, "bytes": b, "phase": ph, "tensor": desc, "where": where}
        for (ph, desc, where), (c, b) in groups.items()
    ]
    return sorted(rows, key=lambda r: -int(r["bytes"]))  # type: ignore[call-overload]


def make_mode(tracker: Tracker):  # type: ignore[no-untyped-def]
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    tracker.add(t)
            tracker.sample()
            return out

    return Mode()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True): accelerate mixed_precision bf16")
    ap.add_argument("--single", action="store_true", help="one process, no FSDP")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--no-reshard-only-hook",
        action="store_true",
        help="experiment: skip FSDP1's _register_post_backward_reshard_only_hook (frozen units then stay unsharded)",
    )
    ap.add_argument("--out", help="also write the result (largest 25 groups at the peak) to this JSON file")
    ap.add_argument("--config", default="tiny-mistral", help="a folder of benchmarks/published-multi-gpu-cpu-repro/")
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--reentrant", default="true")
    a = ap.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    tracker = Tracker()
    mode = make_mode(tracker)
    if rank == 0:
        mode.__enter__()

    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import MistralConfig, MistralForCausalLM, Trainer, TrainingArguments

    if not a.single:
        allow_cpu_fsdp()
    if a.no_reshard_only_hook:
        from torch.distributed.fsdp import _runtime_utils as ru

        ru._register_post_backward_reshard_only_hook = lambda *_args, **_kwargs: None
    with open(os.path.join(HERE, "published-multi-gpu-cpu-repro", a.config, "config.json")) as f:
        cfg = MistralConfig(**json.load(f))
    cfg._attn_implementation = "sdpa"
    model = MistralForCausalLM(cfg).to(torch.bfloat16)
    peft_cfg = LoraConfig(
        r=16,
        lora_alpha=16,
        lora_dropout=0.1,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, peft_cfg)  # PEFT 0.13.2 default: float32 adapters on a bf16 base
    if not a.no_checkpointing:
        model.enable_input_require_grads()  # what TRL 0.13's SFTTrainer does for a PEFT model with checkpointing

    n_rows = a.seqs * 2 * (a.steps + 1)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, cfg.vocab_size, (a.length,), generator=g) for _ in range(n_rows)]

    class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": rows[i], "labels": rows[i].clone(), "attention_mask": torch.ones_like(rows[i])}

    fsdp_kwargs = {}
    if not a.single:
        fsdp_kwargs = dict(
            fsdp="full_shard auto_wrap",
            fsdp_config={
                # the published runs had BACKWARD_PRE (their accelerate.yaml's fsdp_backward_prefetch); these ran
                # without: with the checkpoint around each unit BACKWARD_PRE prefetches no decoder layer, only a LoRA
                # unit of the layer being recomputed (published-multi-gpu.md, "Backward prefetch")
                "backward_prefetch": "no_prefetch",
                "use_orig_params": True,
                # True needs a CUDA/XPU/NPU device (accelerate 1.0.1 utils/dataclasses.py 1674-1685); every rank builds
                # the same weights from the same seed, so there is nothing to broadcast
                "sync_module_states": False,
                "cpu_ram_efficient_loading": False,
                "transformer_layer_cls_to_wrap": ["MistralDecoderLayer"],
            },
        )
    args = TrainingArguments(
        output_dir="/tmp/i16s_fsdp1_out",
        per_device_train_batch_size=a.seqs,
        max_steps=a.steps,
        gradient_checkpointing=not a.no_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": a.reentrant == "true"},
        bf16=a.bf16,
        optim="adamw_torch",
        learning_rate=1e-4,
        max_grad_norm=1.0,
        logging_steps=1000,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        use_cpu=True,
        ddp_backend="gloo" if not a.single else None,
        skip_memory_metrics=True,
        **fsdp_kwargs,
    )

    class T(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):  # type: ignore[no-untyped-def]
            tracker.set_phase("forward")
            return super().compute_loss(model, inputs, *args, **kwargs)

        def create_optimizer(self):  # type: ignore[no-untyped-def]
            opt = super().create_optimizer()
            opt.register_step_pre_hook(lambda *_: tracker.set_phase("optimizer"))
            return opt

    trainer = T(model=model, args=args, train_dataset=Rows())
    orig_backward = trainer.accelerator.backward

    def backward(loss, **kw):  # type: ignore[no-untyped-def]
        tracker.set_phase("backward")
        orig_backward(loss, **kw)
        tracker.set_phase("after_backward")

    trainer.accelerator.backward = backward
    tracker.set_phase("setup")
    trainer.train()
    tracker.set_phase("end")
    if rank == 0:
        mode.__exit__(None, None, None)
        wrapped = trainer.model_wrapped
        out = {
            "stack": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "accelerate": __import__("accelerate").__version__,
                "peft": __import__("peft").__version__,
            },
            "setup": "single" if a.single else "fsdp1 x2 gloo",
            "model_class": type(wrapped).__name__,
            "config": a.config,
            "reshard_only_hook": not a.no_reshard_only_hook,
            "reentrant": a.reentrant,
            "fsdp_mixed_precision": str(getattr(wrapped, "mixed_precision", None)),
            "mixed_precision": trainer.accelerator.mixed_precision,
            "seqs": a.seqs,
            "length": a.length,
            "peak": tracker.peak,
            "peak_phase": tracker.peak_phase,
            "phases": tracker.peaks,
            "after_train": sum(n for n, *_ in tracker.sizes()),
            "at_peak": at_peak_groups(tracker.at_peak),
        }
        print("RESULT " + json.dumps(out))
        if a.out:
            with open(a.out, "w") as f:
                json.dump({**out, "at_peak": out["at_peak"][:25]}, f, indent=1)


if __name__ == "__main__":
    main()
