"""Hidden states recorded while the model samples its answer, with no second forward pass.

`sample_with_states` runs the DAG's sampler (`generation.sample_rows`: one random stream per
row, stop strings, the same trimming) with a hook on one layer that keeps what every forward
of the sampling pass computes there: the prefill [R, W, d] over the left-padded prompts, then
[R, 1, d] per decode step. Joined along the sequence, column W - 1 + i is the state that
predicts answer token i (`predicting` bags) and column W + i the state at token i itself
(`generated` bags), the states the dump's teacher-forced pass computes, up to float noise
(left padding and a KV cache against one right-padded pass; tests/test_scoring.py bounds it).

`stream` (what `halludetect serve` passes for a streamed request, scoring/serve.py): an object whose
`rows(index)` is the same for the rows `index` of its rows (a batch, the empty answers sampled
again), and whose `call(width, steps)` gives the transformers streamer and the stopping criteria of
one `generate` call over its rows, `steps` being the list this hook fills: the states so far.

One state is never computed while sampling: the `generated` state of the last token of an
answer cut by max_new_tokens, because generation stops before feeding that token back. One
more decode step on the sampling pass's own KV cache computes it: the step sampling would
have taken next, not a second pass over the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from halludetect.activations.capture import bag_slice, layer_module
from halludetect.config import GenerateParams
from halludetect.lm.generation import Trimmed, sample_rows
from halludetect.lm.hf_models import cache_kwarg, passed_cache
from halludetect.lm.model_inputs import pad_ids


@dataclass
class SampledAnswer:
    answer: Trimmed
    states: torch.Tensor | None  # [n_tokens, d] the bag, in the stored dtype's values (float32); None if empty
    logprobs: list[float] | None = None  # each answer token's raw log-prob, as the sampler recorded it


@torch.no_grad()
def _sample_once(
    model,
    tokenizer,
    prompts: list[list[int]],
    keys: list[tuple],
    params: GenerateParams,
    eos: list[int],
    layer: int | None,
    positions: str,
    states_dtype: torch.dtype,
    greedy: bool,
    stream=None,
) -> list[SampledAnswer]:
    steps: list[torch.Tensor] = []  # each forward's states at `layer`: [R, W, d], then [R, 1, d] per step
    width = max(map(len, prompts))
    streamer, stopping = stream.call(width, steps) if stream is not None else (None, None)
    run = {"streamer": streamer, "stopping": stopping}
    if layer is None:  # the answers alone: sampling as the DAG samples, no hook (a benchmark's baseline)
        answers, logprobs, _ = sample_rows(model, tokenizer, prompts, keys, params, eos, greedy=greedy, **run)
        return [SampledAnswer(a, None, lp) for a, lp in zip(answers, logprobs)]
    last_call: dict = {}

    def keep(_module, _inputs, output):
        steps.append((output[0] if isinstance(output, tuple) else output).detach())

    def watch(_module, _args, kwargs):  # the sampling pass's KV cache, for the step after its last
        last_call["cache"] = passed_cache(kwargs)

    handles = [layer_module(model, layer).register_forward_hook(keep)]
    if positions == "generated":  # only that convention takes the extra step (a hook costs every step)
        handles.append(model.register_forward_pre_hook(watch, with_kwargs=True))
    try:
        answers, logprobs, _ = sample_rows(model, tokenizer, prompts, keys, params, eos, greedy=greedy, **run)
        generated = sum(s.shape[1] for s in steps) - width + 1  # tokens sampled: one per forward
        cut = [len(a.token_ids) == generated for a in answers]  # answers whose last token was never fed back
        if positions == "generated" and any(cut):
            # The mask generate keeps: the left-padded prompts' own, then one column per token sampled.
            _, prompt_mask = pad_ids(prompts, tokenizer.pad_token_id, left=True)  # [R, W]
            mask = torch.cat([prompt_mask, torch.ones(len(prompts), generated, dtype=prompt_mask.dtype)], dim=1)
            mask = mask.to(steps[0].device)  # [R, W + generated]
            last = torch.tensor(
                [a.token_ids[-1] if c else tokenizer.pad_token_id for a, c in zip(answers, cut)], device=mask.device
            )[:, None]  # [R, 1]
            model(
                input_ids=last,
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1)[:, -1:],
                use_cache=True,
                **{cache_kwarg(model): last_call["cache"]},
            )
    finally:
        for h in handles:
            h.remove()
    seq = torch.cat(steps, dim=1)  # [R, W + generated - 1 (+ 1), d]
    out = []
    for r, a in enumerate(answers):
        n = len(a.token_ids)
        bag = seq[r, bag_slice(width, n, positions)] if n else None  # every prompt ends at column W - 1
        out.append(SampledAnswer(a, None if bag is None else bag.to(states_dtype).float(), logprobs[r]))
    return out


def sample_with_states(
    model,
    tokenizer,
    prompts: list[list[int]],
    keys: list[tuple],
    params: GenerateParams,
    eos: list[int],
    *,
    layer: int | None,
    positions: str,
    states_dtype: torch.dtype,
    greedy: bool = False,
    stream=None,
) -> list[SampledAnswer]:
    """One answer per prompt with its bag of `layer` states (`layer` None: no states, the answers
    only, sampled exactly as with a layer). `keys` are the rows' random-stream
    keys (seed, id, sample index, attempt); an empty answer is sampled again with the next
    attempt, at most `params.empty_retries` times, as the generate stage does."""
    out = _sample_once(model, tokenizer, prompts, keys, params, eos, layer, positions, states_dtype, greedy, stream)
    for attempt in range(1, 0 if greedy else params.empty_retries + 1):
        empty = [r for r, s in enumerate(out) if not s.answer.token_ids]
        if not empty:
            break
        again = _sample_once(
            model,
            tokenizer,
            [prompts[r] for r in empty],
            [(*keys[r][:3], attempt) for r in empty],
            params,
            eos,
            layer,
            positions,
            states_dtype,
            greedy,
            None if stream is None else stream.rows(empty),
        )
        for r, s in zip(empty, again):
            out[r] = s
    return out
