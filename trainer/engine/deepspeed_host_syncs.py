"""Which per-step host reads a DeepSpeed config brings (DeepSpeed 0.19.8), and why.

A host read in the step (a flag or a norm copied to the host) stalls the host until the device has
finished everything queued before it, so the host cannot queue the next step's kernels ahead.
DeepSpeed's optimizers read:

- stage 0 with ``bf16.enabled``: its bf16 optimizer checks every gradient for overflow, with no
  switch to turn it off;
- stage 1 with ``bf16`` and fp32 gradient accumulation: its BF16_Optimizer computes the gradient
  norm every step and refuses ``compute_grad_norm: false``;
- stages 1 and 2 otherwise: the overflow check (``bf16.check_grad_overflow``, bf16 only) and the
  gradient norm (``zero_optimization.compute_grad_norm``), each unless switched off;
- stage 3: the overflow check, always.

Stage 0 with ``torch_autocast`` (fp32 weights and gradients, bf16 compute) or in fp32 reads
nothing: the job's optimizer runs unwrapped, and DeepSpeed's gradient clipping there
(``clip_fp32_gradients``) stays on the device.  At stages 1-2 clipping needs the gradient norm,
which ``load_deepspeed_config`` refuses to combine with ``compute_grad_norm: false``.

Two more, from the engine rather than the optimizer:

- DeepSpeed's throughput timer (``timers.throughput``, on by default in DeepSpeed) synchronises the
  device when it starts, in every forward, and when it stops, in ``step()``, from step 3 on: two
  device-wide waits a step.  ``load_deepspeed_config`` turns it off unless the file asks for it.
- stage-0 gradient clipping (``gradient_clipping`` with unwrapped fp32 gradients) runs
  ``deepspeed.runtime.utils.clip_grad_norm_``, which copies two Python numbers to the device every
  step (``torch.tensor([...], device=...)``) and all-reduces the norm.

Without DeepSpeed's checks the trainer still watches the loss and the gradients for NaN and inf on
the device (``optim.on_nonfinite``, ``trainer.engine.gradient_watch``).
``tests/integration/test_deepspeed_host_syncs.py`` holds these rules against the reads a step makes.
"""

from __future__ import annotations


def host_reads_per_step(ds_config: dict) -> list[str]:
    """Why a step under ``ds_config`` reads the host (empty: it does not)."""
    zero = ds_config.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    bf16 = ds_config.get("bf16", {})
    bf16_engine = bool(bf16.get("enabled", False))
    fp32_accumulation = ds_config.get("data_types", {}).get("grad_accum_dtype") in ("fp32", "float32")
    reasons = []
    if stage == 0 and bf16_engine:
        reasons.append("the bf16 stage-0 optimizer checks for overflow (no switch: use torch_autocast, as "
                       "ds_configs/zero0_autocast_bf16.json does)")
    elif stage == 1 and bf16_engine and fp32_accumulation:
        reasons.append("ZeRO-1 with bf16 weights and fp32 gradients runs DeepSpeed's BF16_Optimizer, which computes "
                       "the gradient norm (it refuses compute_grad_norm: false)")
    elif stage in (1, 2):
        if bf16_engine and bf16.get("check_grad_overflow", True):
            reasons.append("the overflow check (bf16.check_grad_overflow: false turns it off)")
        if zero.get("compute_grad_norm", True):
            reasons.append("the gradient norm (zero_optimization.compute_grad_norm: false turns it off)")
    elif stage == 3:
        reasons.append("ZeRO-3 checks for overflow (no switch)")
    throughput = ds_config.get("timers", {}).get("throughput", {})
    if throughput.get("enabled", True) and throughput.get("synchronized", True):
        reasons.append("DeepSpeed's throughput timer synchronises the device at every forward and step "
                       "(timers.throughput.enabled: true; remove the key, or set it false or synchronized: false)")
    if stage == 0 and not bf16_engine and float(ds_config.get("gradient_clipping", 0) or 0) > 0:
        reasons.append("stage-0 gradient clipping copies two numbers to the device and all-reduces the norm every "
                       "step (DeepSpeed's clip_grad_norm_)")
    return reasons
