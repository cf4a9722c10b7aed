"""GRPO's training step as TRL 1.16's ``GRPOTrainer`` runs it with transformers' ``generate`` or with vLLM
(``objective_settings.use_vllm``), micro-step by micro-step (``training.objective: grpo``).

Read in ``trl/trainer/grpo_trainer.py`` (TRL 1.16.0); every line cited below is of that file unless named:

1. the batch: the dataloader hands over prompts (text: no tensors, :1258-1278); ``_prepare_inputs`` (:1521-1550)
   generates once every ``steps_per_generation`` micro-steps for the whole generation batch (``microbatch x
   steps_per_generation`` completions, ``num_generations`` per prompt), shuffles it and splits it into the micro-steps'
   slices, which stay buffered until the next generation has replaced them (``self._buffered_inputs``);
2. the generation phase (``_generate_and_score_completions``, :2324-2937; a phase of its own in the ledger,
   ``generation_peak``): the prompts left-padded (``_generate_single_turn``, :1811-1892; TRL's ``pad``), the
   policy's ``generate`` under ``no_grad`` with checkpointing off (``unwrap_model_for_generation``, models/utils.py:
   134-154) and TRL's generation config (:1150-1173: sampling, the KV cache of transformers' ``generate``), the
   completions read back to lists; then the padded prompt and completion tensors (:2441-2462), the old-policy
   log-probs only when ``gradient_accumulation_steps`` is not a multiple of ``steps_per_generation`` (:2632-2652), the
   reference's with ``beta > 0`` (the same PEFT model with its adapters off, :2688-2716), both without grad and
   checkpointing and in chunks of ``microbatch`` rows (``_get_per_token_logps_and_entropies``, :1418-1508, through
   TRL's fused LM head), the rewards and the group-normalised advantages (:2727-2795);
3. the training forward (``_compute_loss``, :3020-3293): prompt + completion through the fused LM head (fields
   ``log_probs`` and ``entropy``, :1066-1071), TRL's default loss (``loss_type: dapo``, token-level importance
   weights, two-sided clipping, normalised by the generation batch's completion tokens, :3160-3166) with the KL term
   when ``beta > 0``, and the metrics TRL logs (:3254-3285); the loss is already scaled for accumulation
   (``loss_is_scaled_for_ga = True``, :285), then backward and the optimizer step as for SFT.

With vLLM (``use_vllm``, server or colocate mode) the generation phase holds no ``generate``: the weight sync
(``VLLMGeneration.sync_weights``, generation/vllm_generation.py:481-513: PEFT's own ``merge_adapter`` and
``unmerge_adapter`` around the parameter walk, in server mode vLLM's packed broadcast chunks), the completions and
their log-probs back as lists, and TRL's importance-sampling correction (the old policy's log-probs always, the
sequence ratio buffered with the batch and applied to the loss, :2639-2706, :3146-3147). Colocated vLLM's share of
the card is the device verdict's (``devices.target.vllm_share_of``), not a tensor of this step.

The simulation runs transformers' own ``generate`` and TRL's ``pad``, ``nanstd``, ``shuffle_sequence_dict`` and
``split_tensor_dict``. Every completion is ``max_completion_length`` tokens (the worst case: generation runs with an
end-of-sequence id outside the vocabulary, as the truth's tokenizer does). What a fake tensor cannot do is replaced by
what the real one would allocate: the host reads (``.item()``, ``.tolist()``, the stop check of ``generate``) are
answered without a tensor, the boolean selections of rows with an end-of-sequence token or a NaN reward select none
(none has), those of the metrics' non-NaN values select them all.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ledgerspec.derivations.engine.preference import DPOLoop

#: GRPOConfig's defaults (grpo_config.py): ``epsilon`` 0.2 (:693), ``temperature`` 1.0 (:532)
EPSILON = 0.2
#: GRPOConfig's ``vllm_importance_sampling_clip_max`` (grpo_config.py:947-948; ``clip_min`` None: no lower bound)
IS_CLIP_MAX = 3.0
#: vLLM's packed weight transfer on the trainer side (``packed_nccl_broadcast_producer``,
#: vllm/distributed/weight_transfer/packed_tensor.py, vllm-project/vllm@00a9ccfb): chunks of just over this many
#: bytes (``DEFAULT_PACKED_BUFFER_SIZE_BYTES``), this many in flight (``DEFAULT_PACKED_NUM_BUFFERS``)
PACKED_BUFFER, PACKED_SLOTS = 1024 * 1024 * 1024, 2


@contextlib.contextmanager
def _fake_host_reads(length: int) -> Any:
    """On fake tensors: ``generate``'s host reads answered (a right-padding check: none; the stop check: done when the
    sequences reach ``length`` tokens, as with no end-of-sequence token sampled), its tensors still made."""
    import torch
    from torch._subclasses import fake_impls
    from transformers.generation import utils as gen_utils

    table = fake_impls.op_implementations_dict
    op = torch.ops.aten._local_scalar_dense.default
    original_read, original_check = table[op], gen_utils.StopCheck.__call__

    def read(fake_mode: Any, func: Any, arg: Any) -> Any:
        return 0

    def check(self: Any, unfinished: Any, tokens: Any, now: int) -> bool:
        _ = unfinished.max() == 0
        return now >= length

    table[op] = read
    gen_utils.StopCheck.__call__ = check
    try:
        yield
    finally:
        table[op] = original_read
        gen_utils.StopCheck.__call__ = original_check


def _masked_seq_mean(x: Any, mask: Any) -> Any:
    """``_compute_loss``'s ``masked_seq_mean`` (:3254-3257), token level."""
    return (x * mask).sum(-1) / mask.sum(-1)


def _global_masked_mean(x: Any, mask: Any) -> None:
    """``_compute_loss``'s ``global_masked_mean`` (:3259-3265): ``accelerator.reduce`` clones on one process, the
    quotient is read on the host."""
    import torch

    local_sum, local_count = (x * mask).sum(), mask.sum().float()
    totals = torch.stack([local_sum, local_count]).clone()
    _ = totals[0] / totals[1].clamp(min=1.0)


def _importance_sampling_ratio(old: Any, sampling: Any, mask: Any) -> Any:
    """vLLM's importance-sampling ratio at GRPOConfig's defaults (:2659-2706: ``sequence_mask``, clipped above at
    :data:`IS_CLIP_MAX`, no lower bound): one float per sequence."""
    import math

    import torch

    per_token_logps_diff = (old - sampling) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    del per_token_logps_diff
    ratio = torch.exp(logps_diff)
    del logps_diff
    invalid_mis_mask = (ratio < -math.inf) | (ratio > IS_CLIP_MAX)
    return ratio.masked_fill(invalid_mis_mask, value=0.0)


def _importance_sampling_metrics(old: Any, sampling: Any, completion_mask: Any, ratio: Any) -> None:
    """The sampling metrics TRL logs with the correction (:2860-2896), read on the host: the log-prob differences of
    the completion tokens (none is NaN: all selected) and the ratio's min, mean and max (TRL's ``nanmin``/``nanmax``
    of the one-process gather, trainer/utils.py:1124-1155)."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    delta = torch.abs(old - sampling)
    mask = completion_mask.bool()
    keep = mask & ~torch.isnan(delta)
    delta = torch.empty((delta.numel(),), dtype=delta.dtype, device=delta.device) if is_fake(delta) else delta[keep]
    del keep, mask
    _ = torch.mean(delta)
    _ = torch.max(delta)
    del delta
    flat_is_ratio = ratio.flatten()
    for reduce in (torch.min, torch.mean, torch.max):
        value = reduce(flat_is_ratio)
        if reduce is not torch.mean:  # nanmin / nanmax: the NaN check, then the non-NaN values selected (one)
            _ = torch.isnan(value).all()
            selected = (
                torch.empty((1,), dtype=value.dtype, device=value.device)
                if is_fake(value)
                else value[~torch.isnan(value)]
            )
            _ = reduce(selected)
        else:
            _ = value.nanmean()


class GRPOLoop(DPOLoop):
    """``GRPOTrainer``'s step (see the module docstring for the source it follows); the reference adapter and the
    switched-off checkpointing are DPO's (TRL's ``use_adapter`` and ``disable_gradient_checkpointing``)."""

    name = "grpo"
    head_outputs = ("log_probs", "entropy")  # :1066-1071

    def __init__(self, workload: Any) -> None:
        super().__init__(workload)
        self.buffered: list[dict[str, Any]] | None = None
        self.steps_done = 0  # optimizer steps taken: TRL's `self._step` is steps_done x accumulation + the micro-step
        self.seq = 0
        self.sampling_per_token_logps: Any = None
        self.last_loaded = -1  # VLLMGeneration: the global step whose weights vLLM holds (grpo_trainer.py:1140)
        self.weight_metadata = False  # VLLMGeneration._weight_metadata collected (vllm_generation.py:285)

    # -- what the step is ---------------------------------------------------------------------------------------------
    @property
    def generations(self) -> int:
        return self.spec.generation.num_generations

    @property
    def steps_per_generation(self) -> int:
        return self.spec.generation.steps_per_generation or self.spec.accumulation

    @property
    def accumulation(self) -> int:
        """The declared accumulation steps (the estimate runs two of its micro-steps: ``prefetch`` keeps the count)."""
        return int(self.spec.prefetch or self.spec.accumulation)

    @property
    def beta(self) -> float:
        return self.spec.generation.beta

    @property
    def vllm(self) -> str | None:
        """``server`` or ``colocate`` when vLLM generates (``use_vllm``), else None."""
        return self.spec.generation.vllm

    @property
    def importance_sampling(self) -> bool:
        """GRPO with vLLM: TRL's ``vllm_importance_sampling_correction`` (default true, grpo_config.py:925-926)."""
        return self.vllm is not None

    def start(self, seq: int, micro_steps: int) -> None:
        self.seq = seq
        super().start(seq, micro_steps)

    def fetch(self, seq: int, micro_steps: int) -> tuple[list[dict[str, Any]], Any]:
        """The dataloader's prompts are text: no tensors, no ``num_items_in_batch``."""
        return [], None

    def _micro(self, i: int) -> int:
        """TRL's ``self._step`` at micro-step ``i`` of this optimizer step (the estimate runs two of the declared
        micro-steps: the count is the declared one's)."""
        return self.steps_done * self.accumulation + i

    def generation_due(self, i: int) -> bool:
        """``_prepare_inputs`` (:1538): generate when ``_step % (steps_per_generation x num_iterations) == 0``."""
        return self.buffered is None or self._micro(i) % self.steps_per_generation == 0

    # -- the generation phase ----------------------------------------------------------------------------------------
    def generate(self, i: int) -> None:
        """``_generate_and_score_completions`` of the generation batch, then its shuffle and split (:1539-1544)."""
        from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

        batch: Any = shuffle_sequence_dict(self._generate_and_score())
        self.buffered = split_tensor_dict(batch, self.steps_per_generation)

    def _vocab(self) -> int:
        return int(self.w.model.get_base_model().config.get_text_config().vocab_size)

    def _generation_config(self) -> Any:
        """TRL's ``GenerationConfig`` (:1150-1173) with GRPOConfig's defaults; the end-of-sequence id is outside the
        vocabulary (every completion runs to ``max_completion_length``)."""
        from transformers import GenerationConfig

        return GenerationConfig(
            max_new_tokens=self.spec.completion,
            do_sample=True,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=[self._vocab()],
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            min_p=None,
            repetition_penalty=1.0,
            cache_implementation=None,
            disable_compile=True,
        )

    def _rows(self) -> int:
        return self.spec.microbatch * self.steps_per_generation

    def _generate_completions(self, rows: int, prompt: int) -> None:
        """``_generate_single_turn`` (:1811-1892) with ``_generate``'s length metrics (:2268-2321): every tensor it
        makes is gone when it returns (the completions go back as lists). With vLLM (:1767-1780): the weights synced
        when the global step moved since the last sync, then vLLM's completions and log-probs come back as lists (no
        tensor of the training process)."""
        if self.vllm is not None:
            if self.steps_done != self.last_loaded:
                self._sync_weights()
                self.last_loaded = self.steps_done
        else:
            self._transformers_generate(rows, prompt)
        self._length_metrics(rows, prompt)

    def _transformers_generate(self, rows: int, prompt: int) -> None:
        """transformers' ``generate`` of the generation batch (:1811-1892)."""
        import torch
        from torch._subclasses.fake_tensor import is_fake
        from trl.trainer.utils import pad

        device = self.w.device
        vocab = self._vocab()
        completion = int(self.spec.completion)
        prompt_tensors = [torch.randint(3, vocab, (prompt,), device=device) for _ in range(rows)]
        padded_ids = pad(prompt_tensors, padding_value=0, padding_side="left")
        attention_mask = pad([torch.ones_like(t) for t in prompt_tensors], padding_value=0, padding_side="left")
        fake = is_fake(padded_ids)
        reads = _fake_host_reads(prompt + completion) if fake else contextlib.nullcontext()
        # unwrap_model_for_generation (and FSDP1's summon_full_params), :1863-1876: the workload says what it gathers
        with self._no_checkpointing(), torch.no_grad(), reads, self.w.generating() as model:
            prompt_completion_ids = model.generate(
                input_ids=padded_ids, attention_mask=attention_mask, generation_config=self._generation_config()
            )
        completion_ids = prompt_completion_ids[:, prompt:]  # :1878-1879
        is_eos = torch.isin(completion_ids, torch.tensor([vocab], device=device))  # :1882
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
        any_eos = is_eos.any(dim=1)
        argmax = is_eos.int().argmax(dim=1)
        if not fake:
            eos_idx[is_eos.any(dim=1)] = argmax[any_eos]
        else:  # no row has one: both selections are empty
            _ = is_eos.any(dim=1)
            _ = torch.empty((0,), dtype=torch.long, device=device)
        del any_eos, argmax
        sequence_indices = torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1)
        completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()
        del is_eos, eos_idx, sequence_indices, prompt_completion_ids, padded_ids, attention_mask, prompt_tensors
        keep = completion_mask.bool()
        for row in range(rows):  # `c[m].tolist()`: each row's completion
            _ = torch.empty((completion,), dtype=torch.long, device=device) if fake else completion_ids[row][keep[row]]
        del keep, completion_mask, completion_ids

    def _length_metrics(self, rows: int, prompt: int) -> None:
        """``_generate``'s length metrics (:2268-2321): one tensor a row each, their reductions read on the host."""
        import torch

        device = self.w.device
        completion = int(self.spec.completion)
        prompt_lengths = torch.tensor([prompt] * rows, device=device)
        completion_lengths = torch.tensor([completion] * rows, device=device)
        _ = prompt_lengths.sum() + completion_lengths.sum()
        for reduce in ("mean", "min", "max"):
            _ = getattr(completion_lengths.float(), reduce)()
        is_truncated = torch.tensor([True] * rows, device=device)  # no completion ended (none sampled the eos id)
        _ = is_truncated.float().mean()
        _ = torch.empty((0,), dtype=torch.long, device=device)  # the terminated completions' lengths: none
        term = torch.zeros(1, device=device)
        for reduce in ("mean", "min", "max"):
            _ = getattr(term.float(), reduce)()

    def _sync_weights(self) -> None:
        """``VLLMGeneration.sync_weights`` (generation/vllm_generation.py:481-513). Server: the first sync walks the
        parameters once for their names, dtypes and shapes (:499-503), then every sync walks them again into vLLM's
        packed broadcast (:505). Colocate: one walk, each parameter handed to vLLM's ``load_weights``, which copies it
        into vLLM's own weights, inside vLLM's share of the card (:509-511)."""
        import torch.distributed as dist

        server = self.vllm == "server"
        if server and not self.weight_metadata:
            for _ in self._iter_named_params():
                pass
            self.weight_metadata = True
        if server and (not dist.is_initialized() or dist.get_rank() == 0):  # accelerator.is_main_process (:504-508)
            self._packed_broadcast(self._iter_named_params())
        else:  # colocate: each parameter to load_weights; server, the other ranks: the walk only (its gathers)
            for _ in self._iter_named_params():
                pass

    def _iter_named_params(self) -> Any:
        """``VLLMGeneration._iter_named_params`` for a PEFT model (:435-470): PEFT's own
        ``merge_adapter`` (each LoRA layer's delta added into its base weight; a 4-bit base dequantized, added and
        quantized again), every base parameter's data, then ``unmerge_adapter``."""
        model = self.w.model
        with self.w.syncing():  # TRL's gather_params around the merge (ZeRO-3: every parameter), :447
            model.merge_adapter()
            for name, param in model.named_parameters():
                name = name.removeprefix("base_model.model.").replace(".base_layer", "")
                if model.prefix in name or "original_module" in name:
                    continue
                yield self.w.synced(param)
            model.unmerge_adapter()

    @staticmethod
    def _packed_broadcast(tensors: Any) -> None:
        """The trainer side of vLLM's ``packed_nccl_broadcast_producer`` (see :data:`PACKED_BUFFER`): each tensor's
        bytes viewed flat, concatenated into a chunk once the chunk passes the buffer size, a slot's previous chunk
        freed before the slot is packed again (the NCCL broadcast itself allocates nothing here)."""
        import torch

        in_flight: list[Any] = [None] * PACKED_SLOTS
        slot = 0
        while True:
            in_flight[slot] = None
            flats, size = [], 0
            for tensor in tensors:
                flat = tensor.contiguous().view(torch.uint8).view(-1)
                flats.append(flat)
                size += flat.numel()
                if size > PACKED_BUFFER:
                    break
            if not flats:
                break
            in_flight[slot] = torch.cat(flats, dim=0)
            del flats
            slot = (slot + 1) % PACKED_SLOTS

    def _generated_tensors(self) -> tuple[Any, Any, Any, Any]:
        """Generation, then the padded prompt and completion tensors of the generation batch (:2441-2462)."""
        import torch
        from trl.trainer.utils import pad

        device = self.w.device
        rows, prompt = self._rows(), self.w.prompt_length(self.seq)
        completion = int(self.spec.completion)
        vocab = self._vocab()
        self._generate_completions(rows, prompt)
        prompt_ids: Any = [torch.randint(3, vocab, (prompt,), device=device) for _ in range(rows)]
        prompt_mask: Any = [torch.ones_like(ids, dtype=torch.long) for ids in prompt_ids]
        prompt_ids = pad(prompt_ids, padding_value=0, padding_side="left")
        prompt_mask = pad(prompt_mask, padding_value=0, padding_side="left")
        completion_ids: Any = [torch.randint(3, vocab, (completion,), device=device) for _ in range(rows)]
        completion_mask: Any = [torch.ones_like(ids, dtype=torch.long) for ids in completion_ids]
        completion_ids = pad(completion_ids, padding_value=0, padding_side="right")
        completion_mask = pad(completion_mask, padding_value=0, padding_side="right")
        if self.importance_sampling:  # vLLM's log-probs of the sampled tokens (:2463-2476), float32
            sampling: Any = [torch.full((completion,), -1.0, device=device) for _ in range(rows)]
            self.sampling_per_token_logps = pad(sampling, padding_value=0.0, padding_side="right")
            del sampling
        return prompt_ids, prompt_mask, completion_ids, completion_mask

    def _generate_and_score(self) -> dict[str, Any]:
        """``_generate_and_score_completions`` (:2324-2937) for text prompts, one reward function, no tools."""
        import torch

        rows, completion = self._rows(), int(self.spec.completion)
        prompt_ids, prompt_mask, completion_ids, completion_mask = self._generated_tensors()
        num_items_in_batch = completion_mask.sum().sum()  # :2496: gather(loss_mask.sum()).sum()
        prompt_completion_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # :2499-2500
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        old_per_token_logps = ref_per_token_logps = None
        sampling_per_token_logps = self.sampling_per_token_logps if self.importance_sampling else None
        self.sampling_per_token_logps = None
        importance_sampling_ratio = None
        with torch.no_grad(), self._no_checkpointing():  # :2629
            # :2639-2652; with vLLM's importance-sampling correction always
            if self.accumulation % self.steps_per_generation != 0 or self.importance_sampling:
                old_per_token_logps, _ = self._logps(prompt_completion_ids, attention_mask, completion, False)
            if sampling_per_token_logps is not None:
                importance_sampling_ratio = _importance_sampling_ratio(
                    old_per_token_logps, sampling_per_token_logps, completion_mask
                )
            if self.beta != 0.0:  # :2688-2716, a PEFT model: the adapters off
                with self._reference_adapter():
                    ref_per_token_logps, _ = self._logps(prompt_completion_ids, attention_mask, completion, False)
        advantages = self._advantages(rows)
        del prompt_completion_ids, attention_mask
        if sampling_per_token_logps is not None:
            _importance_sampling_metrics(
                old_per_token_logps, sampling_per_token_logps, completion_mask, importance_sampling_ratio
            )
        out = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": advantages,
            "num_items_in_batch": num_items_in_batch,
        }
        if old_per_token_logps is not None:
            out["old_per_token_logps"] = old_per_token_logps
        if importance_sampling_ratio is not None:  # :2906-2911
            out["importance_sampling_ratio"] = importance_sampling_ratio
            out["sampling_per_token_logps"] = sampling_per_token_logps
        if ref_per_token_logps is not None:
            out["ref_per_token_logps"] = ref_per_token_logps
        return out

    def _rewards_per_func(self, rows: int) -> Any:
        """``_calculate_rewards`` (:1579-1682) with one Python reward function: a (rows, 1) float32 tensor."""
        import torch

        device = self.w.device
        rewards_per_func = torch.zeros(rows, 1, device=device)  # :1581
        rewards_per_func[:, 0] = torch.tensor([1.0] * rows, dtype=torch.float32, device=device)  # :1633
        _ = torch.isnan(rewards_per_func).all(dim=1).any()  # :1663 (read on the host)
        return rewards_per_func

    def _advantages(self, rows: int) -> Any:
        """The reward (``_calculate_rewards``, :1579-1682: one Python function) and the group-normalised advantages
        with TRL's metrics (:2727-2810, ``sum_then_normalize``, ``scale_rewards: group``)."""
        import torch
        from trl.trainer.utils import nanstd

        device, g = self.w.device, self.generations
        rewards_per_func = self._rewards_per_func(rows)
        weights = torch.ones(1, dtype=torch.float32, device=device)  # self.reward_weights, made at __init__ (:630)
        unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)  # :2735
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)  # :2739
        self._select_none(rewards)  # rewards[unscorable_mask] = nan: no row is unscorable
        mean_grouped_rewards = torch.nanmean(rewards.view(-1, g), dim=1)
        mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(g, dim=0)
        std_rewards = nanstd(rewards.view(-1, g), dim=1)
        std_rewards = std_rewards.repeat_interleave(g, dim=0)
        advantages = rewards - mean_grouped_rewards  # :2762
        advantages = advantages / (std_rewards + 1e-4)
        is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
        del mean_grouped_rewards
        advantages = torch.nan_to_num(advantages, nan=0.0)  # :2785
        all_process_advantages = advantages.clone()  # :2792
        advantages = advantages[slice(0, rows)]
        _ = torch.nanmean(rewards_per_func[:, 0])  # :2796-2800, read on the host
        _ = nanstd(rewards_per_func[:, 0])
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)  # :2801
        self._select_none(rewards)
        _ = torch.nanmean(rewards)
        _ = nanstd(rewards)
        _ = is_std_zero.float().mean()
        del rewards, std_rewards, is_std_zero, all_process_advantages, unscorable_mask, weights, rewards_per_func
        return advantages

    @staticmethod
    def _select_none(t: Any) -> None:
        """``t[mask] = nan`` for a mask that selects nothing (real tensors do it; a fake one cannot know the count)."""
        import torch
        from torch._subclasses.fake_tensor import is_fake

        if not is_fake(t):
            t[torch.zeros(t.shape, dtype=torch.bool, device=t.device)] = torch.nan

    # -- the training forward ----------------------------------------------------------------------------------------
    def _logps(self, input_ids: Any, attention_mask: Any, keep: int, entropy: bool, batch: int | None = None) -> Any:
        """``_get_per_token_logps_and_entropies`` (:1418-1508): chunks of ``batch`` rows (the generation batch's
        passes: ``microbatch``) through the fused LM head; the completion positions' log-probs (and entropies)."""
        import torch

        batch = batch or self.spec.microbatch
        all_logps, all_entropies = [], []
        for start in range(0, input_ids.size(0), batch):
            end = min(start + batch, input_ids.size(0))
            input_ids_batch = input_ids[start:end]
            attention_mask_batch = attention_mask[start:end]
            model_inputs = self.w.model_inputs({"input_ids": input_ids_batch, "attention_mask": attention_mask_batch})
            labels = input_ids_batch.masked_fill(attention_mask_batch == 0, -100)
            labels[:, :-keep] = -100
            outputs = self.call(model_inputs, labels=labels, fused_lm_head=True)
            all_logps.append(outputs.log_probs[:, -keep:])
            if entropy:
                all_entropies.append(outputs.entropy[:, -keep:])
        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if entropy else None
        return logps, entropies

    def forward(self, i: int) -> Any:
        """``_compute_loss`` up to its model call (:3020-3048), on the buffered slice of this micro-step."""
        import torch

        assert self.buffered is not None
        inputs = self.buffered[self._micro(i) % self.steps_per_generation]  # :1546
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logits_to_keep = inputs["completion_ids"].size(1)
        per_token_logps, entropies = self._logps(input_ids, attention_mask, logits_to_keep, True, input_ids.size(0))
        self.held = {
            "inputs": inputs,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "per_token_logps": per_token_logps,
            "entropies": entropies,
        }
        return None

    def loss(self, out: Any, i: int) -> Any:
        """TRL's default loss (``dapo``) and metrics (:3054-3293); what ``_compute_loss`` made goes on return."""
        import torch

        h, self.held = self.held, {}
        inputs, per_token_logps, entropies = h["inputs"], h["per_token_logps"], h["entropies"]
        mask = inputs["completion_mask"]
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old_per_token_logps = inputs.get("old_per_token_logps")
        old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
        log_ratio = per_token_logps - old_per_token_logps  # :3094
        log_importance_weights = log_ratio
        coef_1 = torch.exp(log_importance_weights)
        per_token_kl = None
        if self.beta != 0.0:  # :3108-3115 (use_bias_correction_kl: true)
            ref_per_token_logps = inputs["ref_per_token_logps"]
            per_token_kl = (
                torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
            )
            per_token_kl = per_token_kl * coef_1
        coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)  # :3123
        per_token_loss1 = coef_1 * advantages
        per_token_loss2 = coef_2 * advantages
        per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
        del per_token_loss1, per_token_loss2
        if "importance_sampling_ratio" in inputs:  # :3146-3147
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
        if per_token_kl is not None:
            per_token_loss = per_token_loss + self.beta * per_token_kl  # :3157
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / 1  # :3160-3166 (dapo)
        normalizer = normalizer * self.accumulation / self.steps_per_generation
        loss = (per_token_loss * mask).sum() / normalizer
        _policy_loss = loss.detach()
        del normalizer, per_token_loss

        if per_token_kl is not None:
            _global_masked_mean(per_token_kl, mask)
        _global_masked_mean(entropies, mask)
        is_low_clipped = (coef_1 < 1 - EPSILON) & (advantages < 0)  # :3267-3277
        is_high_clipped = (coef_1 > 1 + EPSILON) & (advantages > 0)
        is_region_clipped = is_low_clipped | is_high_clipped
        _global_masked_mean(is_low_clipped.float(), mask)
        _global_masked_mean(is_high_clipped.float(), mask)
        _global_masked_mean(is_region_clipped.float(), mask)
        self._nan_reduce(_masked_seq_mean(is_low_clipped.float(), mask))
        self._nan_reduce(_masked_seq_mean(is_high_clipped.float(), mask))
        del h, inputs, per_token_logps, entropies, coef_1, coef_2, per_token_kl, log_ratio, log_importance_weights
        del old_per_token_logps, advantages, mask, is_low_clipped, is_high_clipped, is_region_clipped, _policy_loss
        return loss

    @staticmethod
    def _nan_reduce(t: Any) -> None:
        """TRL's ``nanmin``/``nanmax`` (trainer/utils.py:1124-1155) of a 1-D tensor with no NaN: the check, then the
        min of the selected values (all of them)."""
        import torch
        from torch._subclasses.fake_tensor import is_fake

        _ = torch.isnan(t).all()
        keep = ~torch.isnan(t)
        selected = torch.empty_like(t) if is_fake(t) else t[keep]
        _ = torch.min(selected)

    def optimizer_step(self) -> None:
        super().optimizer_step()
        self.steps_done += 1

    def finish(self) -> None:
        super().finish()
        self.buffered = None


__all__ = ["GRPOLoop"]
