"""From sampled answers to a policy-gradient batch: rewards, group advantages, `Batch`.

GRPO samples `n` answers per prompt, scores them, and uses each answer's reward
relative to its group (the other answers to the same prompt) as the advantage of
every token of the answer. `rollout_batch` lays the prompts and answers out as the
training `Batch` that `TrainConfig.policy_loss` / `eqx_tx.policy_loss` read: loss
weights on the answer tokens only, the sampler's log-probs aligned to the targets,
advantages repeated over each answer, and a group id per prompt.
"""

import re
from collections.abc import Sequence

import numpy as np

from ..core.util import length_bucket
from ..infer.generation import Generation
from ..train.batch import Batch


def group_advantages(rewards, *, scale: bool = True, eps: float = 1e-6) -> np.ndarray:
    """`(r - mean) / (std + eps)` within each group (GRPO); `scale=False`: `r - mean`
    (Dr. GRPO, no division by the group's spread).

    **Arguments:** `rewards`: `[groups, n]`.

    **Returns:** float32 `[groups, n]`; a group whose rewards are all equal gets 0.
    """
    r = np.asarray(rewards, np.float64)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [groups, n], got shape {r.shape}")
    centred = r - r.mean(axis=1, keepdims=True)
    if scale:
        centred = centred / (r.std(axis=1, keepdims=True) + eps)
    return centred.astype(np.float32)


def rollout_batch(
    prompts: Sequence[Sequence[int]],
    generations: Sequence[Generation],
    advantages,
    *,
    pad_id: int = 0,
    multiple: int = 16,
) -> Batch:
    """The training batch of `n` sampled answers per prompt.

    **Arguments:**

    - `prompts`: `P` prompts (token ids).
    - `generations`: `P * n` results of `generate(..., n=n)`, prompt-major.
    - `advantages`: `[P, n]` (e.g. `group_advantages`), one per answer.
    - `pad_id`: the padding token.
    - `multiple`: the row length is rounded up to `multiple` times a power of two,
      or three times one (`length_bucket`): answers of every length give few
      distinct shapes to compile, each at most 1.5x the longest row.

    **Returns:** a `Batch` of `P * n` rows `prompt + answer` with `loss_weights` 1 on
    the answer's tokens (the stop token included), `sampler_logprobs`, `advantages`
    and `group_ids` (the prompt's index) on them.
    """
    adv = np.asarray(advantages, np.float32)
    P = len(prompts)
    if P == 0 or len(generations) % P or adv.shape != (P, len(generations) // P):
        raise ValueError(f"{len(generations)} generations and advantages of shape {adv.shape} "
                         f"do not make n answers for each of {P} prompts")
    n = adv.shape[1]
    rows = [(list(prompts[i // n]), g) for i, g in enumerate(generations)]
    T = length_bucket(max(len(p) + len(g.tokens) for p, g in rows) - 1, multiple)
    B = len(rows)
    input_ids = np.full((B, T), pad_id, np.int32)
    target_ids = np.full((B, T), pad_id, np.int32)
    weights, sampler, advantage, groups = (np.zeros((B, T), np.float32) for _ in range(4))
    lengths = np.zeros((B,), np.int32)
    for b, (prompt, g) in enumerate(rows):
        sequence = prompt + list(g.tokens)
        L = len(sequence) - 1
        input_ids[b, :L], target_ids[b, :L], lengths[b] = sequence[:-1], sequence[1:], L
        answer = slice(len(prompt) - 1, L)  # positions whose target is an answer token
        weights[b, answer] = 1.0
        sampler[b, answer] = g.logprobs
        advantage[b, answer] = adv[b // n, b % n]
        groups[b, :] = b // n
    return Batch(input_ids, target_ids, weights, lengths, sampler_logprobs=sampler, advantages=advantage,
                 group_ids=groups.astype(np.int32))


def final_answer(text: str) -> str:
    """The final answer of a completion: after the last `####` or `\\boxed{...}` if
    there is one, else the last whitespace-separated word, without surrounding
    punctuation."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return boxed[-1].strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    words = text.split()
    return words[-1].strip(".,;:!?\"'()[]") if words else ""


def exact_match(completion: str, example: dict) -> float:
    """Reward 1.0 if the completion's `final_answer` equals `example["answer"]`, else 0.0."""
    return float(final_answer(completion) == str(example["answer"]).strip())


def arithmetic_facts(max_operand: int = 4) -> list[dict]:
    """The built-in task: every `{"prompt": "a+b=", "answer": "<a+b>"}` with operands in
    `[0, max_operand]` (25 facts by default: small enough for a few-million-parameter
    model to learn on a CPU)."""
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(max_operand + 1) for b in range(max_operand + 1)]
