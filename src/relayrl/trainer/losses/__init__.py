"""The trainer's algorithms as registries chosen by config enums (see docs/algorithms.md).

- :mod:`.advantages`: advantage estimators (``trainer.loss.advantage``) and DAPO's overlong penalty;
- :mod:`.policy`: policy losses (``trainer.loss.policy_loss``);
- :mod:`.masks`: train/inference mismatch masks (``trainer.loss.mismatch_mask``);
- :mod:`.distill`: the per-token baseline of on-policy distillation (``trainer.loss.distill_baseline``);
- :mod:`.kl`: k1/k2/k3 estimators against a frozen reference (``trainer.loss.kl_*``);
- :mod:`.tokens`: the flat token view they share, and loss aggregation.
"""
