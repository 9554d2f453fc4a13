"""The prefix-shared training pass gives the plain pass's log-probs and gradients (float32: allclose at
rtol 1e-5 / atol 1e-6), with ragged prompts, ragged completions and shuffled rows."""

from __future__ import annotations

import torch
from tiny import make_model, make_tokenizer

from grpo.batch import collate, token_logps
from grpo.data import tokenize_prompts
from grpo.generation import Rollout


def batch_and_model():
    tok = make_tokenizer()
    model = make_model(tok, hidden=64)
    chats = [[{"role": "user", "content": t}] for t in ("hi", "what is two plus two?", "ok")]
    prompts = tokenize_prompts(chats, tok)
    g = torch.Generator().manual_seed(0)
    rows, completions, group = [], [], []
    for k, p in enumerate(prompts):
        for _ in range(4):
            rows.append(p)
            group.append(k)
            completions.append(torch.randint(10, len(tok), (int(torch.randint(1, 9, (1,), generator=g)),),
                                             generator=g).tolist())
    rollout = Rollout(prompt_ids=rows, completion_ids=completions, sampling_logps=[[0.0] * len(c) for c in completions],
                      truncated=[False] * len(rows))
    batch = collate(rollout, torch.zeros(len(rows)), tok.pad_token_id, mask_truncated=False,
                    group=torch.tensor(group))
    order = torch.randperm(len(rows), generator=g)
    return batch.select(order), model


def test_shared_prefix_logps_and_gradients_match_plain():
    batch, model = batch_and_model()
    results = {}
    for share in (False, True):
        model.zero_grad()
        logps, ent = token_logps(model, batch, temperature=0.9, share_prefix=share)
        (logps * batch.mask).sum().backward()
        results[share] = (logps.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()})
    m = batch.mask.bool()
    torch.testing.assert_close(results[True][0][m], results[False][0][m], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[True][1][m], results[False][1][m], rtol=1e-5, atol=1e-5)
    for name, grad in results[False][2].items():
        torch.testing.assert_close(results[True][2][name], grad, rtol=1e-5, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in results[True][2].values())


def test_shared_prefix_bf16_within_tolerance():
    batch, model = batch_and_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, _ = token_logps(model, batch, 1.0, with_entropy=False)
        shared, _ = token_logps(model, batch, 1.0, with_entropy=False, share_prefix=True)
    m = batch.mask.bool()
    # bfloat16 has an 8-bit mantissa: the two paths round differently; log-probs agree to 0.05 nats
    assert (plain[m] - shared[m]).abs().max() < 0.05
