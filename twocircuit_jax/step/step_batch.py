"""The rows of one GRPO step on the mesh, and what its phases add to them: one structure for the loop
(train/step_phases.py fills it) and for the shapes-only programs (step/abstract_step.py builds it from
ShapeDtypeStructs), so the train step's input is written down once.

    rows       tokens, attention_mask [B, T] int32; response_mask [B, T] f32 (the collector's loss mask applied);
               sampler_logp [B, T] f32; sample_id [B] int32; advantages [B] f32
    full_mask  [B, T] f32: every sampled token (the diagnostics' mask; the loss mask may leave rows out)
    truncated  [B] bool: the row hit the generation cap
    old_logp   [B, T] f32: ℓ_old from its own pass (None when the train forward is that pass)
    ref_logp   [B, T] f32: ℓ_ref (grpo.kl_coef > 0), in the codec's view when the codec acts on the reference
    is_weight  [B, T] f32: the importance weights of grpo.tis / grpo.is_mask from the separate pass (None: none)
"""

from __future__ import annotations

from typing import Any, NamedTuple

PASS_KEYS = ("tokens", "attention_mask", "sample_id")  # what a log-prob pass reads (one signature per pass)


class StepBatch(NamedTuple):
    rows: dict
    full_mask: Any
    truncated: Any
    old_logp: Any = None
    ref_logp: Any = None
    is_weight: Any = None

    def pass_rows(self) -> dict:
        """What a log-prob pass over the step's rows reads."""
        return {k: self.rows[k] for k in PASS_KEYS}

    def train_inputs(self, fused_old_pass: bool) -> dict:
        """The dict the train step reads (split into mini-batches by rows). With the fused ℓ_old path the loss
        computes ℓ_old and the diagnostics itself from the full mask and the flags; otherwise it reads ℓ_old and the
        weights of the separate pass."""
        out = dict(self.rows)
        if fused_old_pass:
            out.update(full_mask=self.full_mask, truncated=self.truncated)
        else:
            if self.old_logp is None:
                raise ValueError("the train step reads ℓ_old from the separate pass, and the step has none")
            out["old_logp"] = self.old_logp
            if self.is_weight is not None:
                out["is_weight"] = self.is_weight
        if self.ref_logp is not None:
            out["ref_logp"] = self.ref_logp
        return out
