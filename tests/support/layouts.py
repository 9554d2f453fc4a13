"""Tiny batches and the training pass over them, as the layout tests compare it: groups of random completions,
rows with several turns, the pass's log-probs, entropies and gradients, and what it keeps for backward; the padded
pass against prefix sharing, token trees and forked turns, and FlexAttention's block masks against a dense twin."""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch

from grpo import GRPOConfig
from grpo.algo.losses import policy_loss
from grpo.base.records import Rollout
from grpo.data.prompts import tokenize_prompts
from grpo.learner.batch import collate
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings
from support.tiny import make_model, make_tokenizer

# gradients at atol 5e-6: the attention's sums run over other widths than the padded pass's, so their rounding
# differs (gradients here are of order 0.1)
GRAD_ATOL = 5e-6


def batch_and_model(texts=("hi", "what is two plus two?", "ok"), lengths=(1, 9), seed=0):
    """Groups of 4 random completions (`lengths`: their lengths' range) of the chat prompts `texts`, the rows
    shuffled, and a tiny model."""
    tok = make_tokenizer()
    model = make_model(tok, hidden=64)
    chats = [[{"role": "user", "content": t}] for t in texts]
    prompts = tokenize_prompts(chats, tok)
    g = torch.Generator().manual_seed(seed)
    rows, completions, group = [], [], []
    for k, p in enumerate(prompts):
        for _ in range(4):
            rows.append(p)
            group.append(k)
            completions.append(
                torch.randint(10, len(tok), (int(torch.randint(*lengths, (1,), generator=g)),), generator=g).tolist()
            )
    rollout = Rollout(
        prompt_ids=rows,
        completion_ids=completions,
        sampling_logps=[[0.0] * len(c) for c in completions],
        truncated=[False] * len(rows),
    )
    batch = collate(rollout, torch.zeros(len(rows)), tok.pad_token_id, mask_truncated=False, group=torch.tensor(group))
    order = torch.randperm(len(rows), generator=g)
    return batch.select(order), model


class Scored(NamedTuple):
    logps: torch.Tensor
    entropies: torch.Tensor
    grads: dict[str, torch.Tensor]
    layouts: tuple[str, ...]  # each piece's


def logps_and_grads(model, batch, *layouts, **settings):
    """The training pass at temperature 0.9, its pieces laid out as `layouts` allow (names in `LAYOUTS`; none:
    padded rows, or forked ones for rows with turns), with other `PassSettings` fields from `settings`: log-probs,
    entropies, every parameter's gradient of the log-probs' sum, and each piece's layout."""
    model.zero_grad()
    scored = token_logps(model, batch, PassSettings(0.9, layouts=layouts, **settings))
    (scored.logps * batch.mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return Scored(scored.logps.detach(), scored.entropies, grads, scored.layouts)


def assert_same_pass(a, b, batch, grad_atol=1e-6):
    """float32: log-probs at rtol 1e-5 / atol 1e-6, entropies at atol 1e-5, gradients at rtol 1e-5 / atol
    `grad_atol` times the parameter's largest gradient where that is above 1 (a float32 sum's rounding grows with
    its terms: Gemma 4's scaled embeddings have gradients near 100)."""
    m = batch.mask.bool()
    torch.testing.assert_close(a[0][m], b[0][m], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a[1][m], b[1][m], rtol=1e-5, atol=1e-5)
    for name, grad in b[2].items():
        scale = max(1.0, float(grad.abs().max()))
        torch.testing.assert_close(a[2][name], grad, rtol=1e-5, atol=grad_atol * scale)


def long_completions_batch():
    """Groups of 4 completions of 30-40 tokens after a short prompt: a group's tree is wide, its prompt short."""
    return batch_and_model(texts=("hi", "ok", "go"), lengths=(30, 41), seed=1)


def turns_batch(seed=0):
    """Two groups of three rows, each row up to three turns. A later turn's context is the earlier one's with its
    first sampled tokens dropped (a stripped reasoning block) and tool tokens after (a rendered tool turn), or the
    earlier context and tokens continued as they are; one row is a single turn. Also the turns as separate
    single-turn rows (prompt = context), and where each of the batch's positions sits among them."""
    tok = make_tokenizer()
    g = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(10, len(tok), (n,), generator=g).tolist()

    prompts = [tokens(6), tokens(9)]
    rows, completions, turns, group = [], [], [], []
    for k, prompt in enumerate(prompts):
        for r in range(3):
            spans = [tokens(int(torch.randint(2, 7, (1,), generator=g))) for _ in range(1 if r == 2 else 3)]
            context, start, done = list(prompt), 0, []
            for t, span in enumerate(spans):
                done.append((start, start + len(span), tuple(context)))
                start += len(span)
                # the next turn's history: this turn stripped of its first two tokens, or kept (r == 1, t == 0)
                kept = span if (r == 1 and t == 0) else span[2:]
                context = context + kept + tokens(3)
            rows.append(prompt)
            completions.append([x for span in spans for x in span])
            turns.append(tuple(done) if len(done) > 1 else None)
            group.append(k)
    rollout = Rollout(
        prompt_ids=rows,
        completion_ids=completions,
        sampling_logps=[[0.0] * len(c) for c in completions],
        truncated=[False] * len(rows),
        turns=turns,
    )
    batch = collate(rollout, torch.zeros(len(rows)), tok.pad_token_id, mask_truncated=False, group=torch.tensor(group))
    # the reference: each turn a row of its own
    forks, where = [], []
    for i in range(len(rows)):
        for start, end, context in turns[i] or ((0, len(completions[i]), tuple(rows[i])),):
            where.append((i, start, end, len(forks)))
            forks.append((list(context), completions[i][start:end]))
    single = Rollout(
        prompt_ids=[c for c, _ in forks],
        completion_ids=[s for _, s in forks],
        sampling_logps=[[0.0] * len(s) for _, s in forks],
        truncated=[False] * len(forks),
    )
    singles = collate(single, torch.zeros(len(forks)), tok.pad_token_id, mask_truncated=False)
    order = torch.randperm(len(rows), generator=g)
    return batch, singles, where, order, make_model(tok, hidden=64)


def gathered(values, where, shape):
    """The single-turn rows' per-token values at the batch's positions."""
    out = torch.zeros(shape, dtype=values.dtype)
    for i, start, end, f in where:
        out[i, start:end] = values[f, : end - start]
    return out


def assert_loss_types_gradients_agree(model, batch, loss_type, group, seed=1):
    """`loss_type`'s gradient (old log-probs moved off the policy, a KL term against a reference) through the tree
    pass equals the padded pass's (forked rows, for a batch with turns)."""
    g = torch.Generator().manual_seed(seed)
    advantages = torch.randn(len(batch), generator=g)
    with torch.no_grad():
        base = token_logps(model, batch, PassSettings(0.9, with_entropy=False)).logps
    old = base + 0.05 * torch.randn(base.shape, generator=g)
    ref = base + 0.1 * torch.randn(base.shape, generator=g)
    args = GRPOConfig(
        output_dir="unused", loss_type=loss_type, beta=0.04, per_device_train_batch_size=group, num_generations=group
    )

    def gradient(as_trees):
        model.zero_grad()
        logps = token_logps(model, batch, PassSettings(0.9, layouts=("trees" if as_trees else "padded",))).logps
        loss, _ = policy_loss(logps, old, advantages, batch.mask, args, ref_logps=ref, num_items_in_batch=50.0)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    padded, trees = gradient(False), gradient(True)
    assert any(g.abs().sum() > 0 for g in padded.values())
    for name, grad in padded.items():
        torch.testing.assert_close(trees[name], grad, rtol=1e-5, atol=GRAD_ATOL)


def allowed_pairs(block_mask, rows, width):
    """Where a FlexAttention block mask's rule lets each query attend each key, over `rows` rows of `width`: (R, T,
    T)."""
    b, q, k = torch.arange(rows).view(-1, 1, 1), torch.arange(width).view(1, -1, 1), torch.arange(width).view(1, 1, -1)
    return block_mask.mask_mod(b, 0, q, k)


def dense_twin(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
    """A stand-in for FlexAttention with a backward on the CPU: its block mask's own rule (`allowed_pairs`),
    attended by SDPA (no score softcap: the tiny models have none)."""
    assert softcap is None
    rows, _, width, _ = query.shape
    allowed = allowed_pairs(attention_mask, rows, width).unsqueeze(1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def image_pass(model, batch, images, as_trees, chunk_size=None):
    """The training pass over image rows (`images`: their `ImageInputs`): the log-probs, entropies and every
    parameter's gradient of the log-probs' sum; and how many pieces took each layout."""
    model.zero_grad()
    layouts = ("trees" if as_trees else "padded",)
    scored = token_logps(model, batch, PassSettings(0.9, chunk_size=chunk_size, images=images, layouts=layouts))
    (scored.logps * batch.mask).sum().backward()
    grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    return (scored.logps.detach(), scored.entropies.detach(), grads), Counter(scored.layouts)


def saved_bytes(model, batch, context, autocast=True):
    """Bytes of the distinct tensors (parameters aside) the training pass keeps for backward inside `context`."""
    seen = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), context:
            token_logps(model, batch, PassSettings(0.9, chunked_head=True, layouts=("shared_prefix",)))
    return sum(seen.values())
