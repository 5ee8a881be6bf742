"""What changes a request's logits before temperature, top-k and top-p: penalties, biases and
`min_tokens` (S1, S8; the grammar's mask is `guided.py`'s).

Each follows the definition users know, so a test can hold it to that definition:
- `repetition_penalty` (CTRL, as transformers applies it): every id in the prompt or the output
  so far has its logit divided by the penalty when positive, multiplied when negative;
- `frequency_penalty` and `presence_penalty` (OpenAI): minus `count * frequency` and minus
  `presence` once, for each id by how often it was generated (the prompt does not count);
- `logit_bias` (OpenAI): added to the logits of the ids it names;
- `min_tokens` (vLLM): EOS and the stop token ids are impossible until that many were generated.
Logits come in as the model computed them and leave as a new float32 tensor; the caller's stay.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from disagg.engine.sampling_params import SamplingParams


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                   output_ids: Sequence[int], eos_token_ids: Sequence[int]) -> torch.Tensor:
    """``[vocab_size]`` logits shaped by `params`, given the tokens so far."""
    logits = logits.float().clone()
    vocab_size = logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        seen = seen[seen < vocab_size]
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty,
                                   picked * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        ids = torch.tensor(list(output_ids), dtype=torch.long)
        counts = torch.bincount(ids[ids < vocab_size], minlength=vocab_size).float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    for token_id, bias in params.logit_bias:
        if token_id < vocab_size:  # the node refuses ids outside its vocabulary at admission
            logits[token_id] += bias
    if len(output_ids) < params.min_tokens:
        ends = [t for t in (*eos_token_ids, *params.stop_token_ids) if t < vocab_size]
        logits[ends] = float("-inf")
    return logits
