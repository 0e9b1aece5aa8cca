"""Reinforcement learning on top of sampling and training: group advantages, sampled
answers laid out as a policy-gradient `Batch`, rewards, the built-in arithmetic task.

May import: `eqx_tx.core` .. `models`, `eqx_tx.train`, `eqx_tx.infer`."""

from .rollouts import arithmetic_facts, exact_match, final_answer, group_advantages, rollout_batch

__all__ = ["arithmetic_facts", "exact_match", "final_answer", "group_advantages", "rollout_batch"]
