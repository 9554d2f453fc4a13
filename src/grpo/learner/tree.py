"""Tree packing (`packing="tree"`): the training pass over a micro-batch laid out as one token tree per prompt group.

Each row is one or more sequences: its prompt then its completion, or, for a multi-turn row whose turns were sampled
after rendered histories (`TrainBatch.turns`), each turn's context then the turn's tokens. A group's sequences are
merged on their common prefixes (a trie): the prompt once, each rendered history once, a stripped reasoning block as
a branch no later turn attends to, and no padding. Attention follows an ancestor mask: a token sees the tokens of
its own context and itself, never a sibling branch's; positions follow each token's own context (a completion's
first token is at its context's length, as in the padded pass). So every trained token gets the outputs it gets
scored alone after its own context, while the pass computes each distinct prefix once.

Each tree is laid out in depth-first order, so a token's descendants are the tokens right after it, up to the last
of its subtree (`Tree.last`): a query attends a key where the key is at or before it and the query at or before the
key's subtree's end. (A model whose image tokens attend each other both ways, Gemma 3, has each run of image tokens
attended from its first token on: `Tree.first`.) Those (R, T) tensors give both masks the pass uses
(`grpo.learner.tree_attention`): the
dense (R, 1, T, T) mask, which attends every pair of a row, so that a row costs the square of its width and a group
may be cut into trees of consecutive rows (each with the prompt once more) where a cost model of tokens against
(query, key) pairs says that is cheaper (`layout`, `pair_cost`); and on CUDA FlexAttention's block mask, which
computes only the blocks where a query attends a key, so that a group stays one tree.

Trees are packed side by side into rows of the widest tree's width. Only a row's end is padding (those positions
attend to themselves alone and no real token attends to them).

The padded layout's counterpart for rows with turns is `forked`: one row per turn, its context as the prompt (what
other trainers do to train such histories exactly).

`unsupported_reason` names the models and settings where a prepared mask would not give the padded pass's numbers,
which keep the padded layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from grpo.base.records import left_pad, right_pad
from grpo.learner import tree_attention
from grpo.learner import windows as model_windows
from grpo.learner.batch import TrainBatch
from grpo.learner.prefix import shared_prompts
from grpo.models.modeling import attention_shapes, keeps_recurrent_state, layer_configs, unwrap

# the attention implementations that read a prepared 4D mask as it is given (a boolean one for SDPA, an additive one
# for eager attention)
_MASKED = ("sdpa", "eager")


@dataclass(frozen=True)
class Tree:
    """A micro-batch as trees: `input_ids`, `positions` and `real` (R, T) for R rows of one or more trees side by
    side, each tree in depth-first preorder; `origin` (R, T) the sequence that added each token (0 at padding),
    numbered over the rows' sequences in order (`sequence_ids`: a row without turns is one, so its number is the
    row's; with turns, the forked row's of `forked`), so a token's place in that sequence is its position;
    `first` and `last` (R, T) the columns of the first and the last query that attend each key: a query at column q
    may attend the key at column k where first[k] <= q <= last[k] (`mask`). `last` is the last token of the key's
    subtree (its own column at padding); `first` is the key's own column, or for a key in a run of image tokens
    that attend each other both ways (`layout`'s `run_layers`) its run's first column. For each completion position
    of the batch (B, C) the row and column whose output predicts it (`row`, `column`); the attention `kernel` it is
    laid out for (`tree_attention.attention_kernel`: "dense" or "flex"); and the types of the layers in which runs
    attend each other both ways (`run_layers`, None where there are no runs; the model's other layers, Gemma 4's
    global ones, attend the tree's ancestors alone: `without_runs`)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    real: torch.Tensor
    origin: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    row: torch.Tensor
    column: torch.Tensor
    kernel: str = "dense"
    run_layers: tuple[str, ...] | None = None

    @property
    def mask(self) -> torch.Tensor:
        """(R, 1, T, T) True where a query may attend a key: the key is the query's token or one of its ancestors,
        or in the query's run of image tokens that attend each other both ways (padding sees itself alone: no
        softmax over nothing)."""
        columns = torch.arange(self.last.shape[1], device=self.last.device)
        query = columns.view(1, -1, 1)
        return ((self.first.unsqueeze(1) <= query) & (query <= self.last.unsqueeze(1))).unsqueeze(1)

    def without_runs(self) -> Tree:
        """The same trees, each key attended from its own column on: its descendants alone (no run of image tokens
        attended both ways)."""
        rows, width = self.first.shape
        own = torch.arange(width, device=self.first.device).expand(rows, width)
        return dataclasses.replace(self, first=own, run_layers=None)

    @property
    def positions_computed(self) -> int:
        """Positions the pass computes (rows times their padded width)."""
        return self.input_ids.numel()

    @property
    def pairs_computed(self) -> int:
        """(query, key) pairs the attention computes: under the dense mask rows times their width squared; with
        FlexAttention each block of FLEX_BLOCK queries by FLEX_BLOCK keys where one query attends one key
        (`tree_attention.flex_blocks`)."""
        if self.kernel == "flex":
            return tree_attention.flex_blocks(self.first, self.last) * tree_attention.FLEX_BLOCK**2
        return self.input_ids.shape[0] * self.input_ids.shape[1] ** 2


# A tree's most tokens: the mask and the attention grow with the square of a row's length, so a group whose prompt
# and completions add up to more is cut into several trees, each with the prompt once (the same numbers; a tree of
# one completion may be longer). `layout` cuts narrower where its cost model says so.
MAX_WIDTH = 2048

# `pair_cost` where a model's config does not say (SmolLM2-135M's): attention's work per (query, key) pair over a
# token's work in the layers' projections
PAIR_COST = 3.3e-4


class _Trie:
    """Token sequences merged on their common prefixes: node k holds `tokens[k]` after its ancestors, `parent[k]`
    (-1 at a root), `depth[k]` (its position) and `origin[k]` (the sequence that added it: its tag, `insert`).
    Nodes are numbered in insertion order, so every node comes after its ancestors (the causal order the model's
    mask needs). A sequence's item is a token id, or (token id, mark) for a token that equal ids do not make the
    same (an image's token, marked with which image and where in it: `layout`'s `marks`)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.origin: list[int] = []
        self.marked: list[bool] = []
        self.children: dict[tuple[int, Any], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def insert(self, sequence: list, tag: int = 0) -> list[int]:
        """The node of each item of `sequence`, adding those its prefixes lack (with `tag` as their origin)."""
        nodes, node = [], -1
        for depth, item in enumerate(sequence):
            key = (node, item)
            found = self.children.get(key)
            if found is None:
                found = self.children[key] = len(self.tokens)
                self.tokens.append(item if isinstance(item, int) else item[0])
                self.parent.append(node)
                self.depth.append(depth)
                self.origin.append(tag)
                self.marked.append(not isinstance(item, int))
            node = found
            nodes.append(node)
        return nodes

    def added(self, sequences: list[list]) -> int:
        """How many nodes inserting `sequences` would add (the trie unchanged)."""
        extra: dict[tuple[int, Any], int] = {}  # the would-be nodes, numbered after the trie's own
        for sequence in sequences:
            node = -1
            for item in sequence:
                key = (node, item)
                found = self.children.get(key)
                if found is None:
                    found = extra.setdefault(key, len(self.tokens) + len(extra))
                node = found
        return len(extra)

    def runs(self) -> np.ndarray:
        """Each node's run: for a marked node, the first node of the chain of marked nodes it ends (its image's
        first token, where an image's tokens run on their own); for any other, itself. A run must not branch (no
        node of a run has a marked child and another child): its tokens then are one chain, contiguous in preorder."""
        first = np.arange(len(self), dtype=np.int64)
        children = np.bincount(np.asarray(self.parent, dtype=np.int64) + 1, minlength=len(self) + 1)[1:]
        for k, parent in enumerate(self.parent):
            if self.marked[k] and parent >= 0 and self.marked[parent]:
                if children[parent] != 1:
                    raise ValueError("a run of image tokens branches in the tree")
                first[k] = first[parent]
        return first

    def preorder(self) -> tuple[np.ndarray, np.ndarray]:
        """Each node's place in depth-first preorder (children in insertion order), and the place of the last node
        of its subtree there: in that order a node's descendants are the places right after it, up to that one,
        so node j is node i or one of its ancestors exactly where place[j] <= place[i] <= last[j]."""
        n = len(self)
        children: list[list[int]] = [[] for _ in range(n)]
        roots: list[int] = []
        for k, parent in enumerate(self.parent):
            (children[parent] if parent >= 0 else roots).append(k)
        size = [1] * n
        for k in range(n - 1, -1, -1):  # a node is numbered after its parent: its subtree is counted first
            if self.parent[k] >= 0:
                size[self.parent[k]] += size[k]
        place = np.zeros(n, dtype=np.int64)
        stack, at = roots[::-1], 0
        while stack:
            k = stack.pop()
            place[k], at = at, at + 1
            stack.extend(children[k][::-1])
        return place, place + np.asarray(size, dtype=np.int64) - 1


def contexts(batch: TrainBatch, i: int, prompt: list[int], length: int) -> list[tuple[list[int], int, int]]:
    """Row `i`'s turns as (context, start, end): its completion positions start..end-1 continue `context` (every
    token before them: a multi-turn rollout's rendered history), cut at the row's `length` attended tokens. A row
    without turns is one: the prompt, then the whole completion."""
    turns = batch.turns[i] if batch.turns is not None else None
    if turns is None:
        return [(prompt, 0, length)]
    return [(list(context), start, min(end, length)) for start, end, context in turns if start < length]


def host_turns(batch: TrainBatch) -> list[list[tuple[list[int], int, int, list[int]]]]:
    """Each row's turns on the host, as lists: (context, start, end, the completion's tokens start..end-1)."""
    prompt_ids, prompt_mask = batch.prompt_ids.cpu(), batch.prompt_mask.cpu()
    completion_ids = batch.completion_ids.cpu().tolist()
    lengths = batch.completion_attention.sum(-1).tolist()
    rows = []
    for i in range(len(batch)):
        prompt = prompt_ids[i][prompt_mask[i].bool()].tolist()
        turns = contexts(batch, i, prompt, int(lengths[i]))
        rows.append([(context, start, end, completion_ids[i][start:end]) for context, start, end in turns])
    return rows


def pair_cost(model: Any) -> float:
    """The attention's multiply-adds per (query, key) pair over a token's multiply-adds in a layer's projections
    and MLP, from the model's config: what a row's width costs (a dense mask attends every pair of a row) against
    what its tokens cost. Counted on the CPU, the training pass's time follows it (bench/tree_packing.py)."""
    config = tree_attention.text_config(model)
    shapes = attention_shapes(config)
    if shapes is None:
        return PAIR_COST
    token = pair = 0
    for i, (layer, (heads, kv, head)) in enumerate(zip(layer_configs(config), shapes)):
        d = layer.hidden_size
        inner = getattr(layer, "intermediate_size", None) or 4 * d
        if isinstance(inner, (list, tuple)):  # one per layer (Gemma 3n)
            inner = inner[i]
        token += 2 * d * heads * head + 2 * d * kv * head + 3 * d * inner  # q and o, k and v, a gated MLP
        pair += 2 * heads * head  # q.k and the weighted sum of v
    return pair / token


# a trie and its rows' nodes ({row: the nodes of each of its sequences})
_Placed = tuple[_Trie, dict[int, list[list[int]]]]


def sequence_ids(counts: list[int]) -> list[list[int]]:
    """Each row's sequences numbered in order over the rows, for rows of `counts` sequences each (`Tree.origin`)."""
    ends = np.cumsum(counts).tolist()
    return [list(range(end - count, end)) for count, end in zip(counts, ends)]


def _cut(
    groups: dict[int, list[int]], sequences: list[list[list]], numbers: list[list[int]], cap: int
) -> list[_Placed]:
    """Each group's rows, in order, cut into tries of at most `cap` nodes (a row alone may pass it): for each trie,
    its rows' nodes (each sequence's tagged with its number, `numbers`: `sequence_ids`)."""
    trees: list[_Placed] = []
    for rows in groups.values():
        trie = _Trie()
        placed: dict[int, list[list[int]]] = {}
        for i in rows:
            if len(trie) and len(trie) + trie.added(sequences[i]) > cap:
                trees.append((trie, placed))
                trie, placed = _Trie(), {}
            placed[i] = [trie.insert(sequence, n) for sequence, n in zip(sequences[i], numbers[i])]
        trees.append((trie, placed))
    return trees


def _pack(sizes: list[int], width: int) -> list[list[int]]:
    """Trees of `sizes` into as few rows of `width` as first fit finds, the largest first: each row's trees."""
    rows: list[list[int]] = []
    room: list[int] = []
    for t in sorted(range(len(sizes)), key=lambda t: -sizes[t]):
        fits = next((r for r, free in enumerate(room) if sizes[t] <= free), None)
        if fits is None:
            rows.append([t])
            room.append(width - sizes[t])
        else:
            rows[fits].append(t)
            room[fits] -= sizes[t]
    return rows


def layout(
    batch: TrainBatch,
    max_width: int | None = None,
    pair_cost: float = 0.0,
    kernel: str = "dense",
    marks: list[list[Any]] | None = None,
    run_layers: tuple[str, ...] = (),
) -> Tree:
    """`batch`'s rows as token trees: each group's (`batch.group`) rows merged on their common prefixes (each row's
    sequences, `contexts`: the prompt and its completion, or with turns each turn's context and tokens; completions
    are their attended tokens, `completion_attention`, a prefix of each row), so every distinct prefix is computed
    once. A group may be cut into several trees of consecutive rows, none past `max_width` tokens unless a row alone
    is; the trees are packed side by side into rows of the widest tree's width (a row holds several small trees,
    each attending only within itself).

    Where to cut is a cost: each computed token costs 1, each (query, key) pair of a row `pair_cost` (`pair_cost`:
    the dense mask attends every pair). Of the cuts at the widest row alone, its doubles, each group whole and
    `max_width`, the cheapest is taken; with `pair_cost` 0, the widest (the fewest tokens). For the "flex" `kernel`
    (`tree_attention.attention_kernel`), pairs cost nothing here: FlexAttention attends each tree's own blocks
    only, so a cut adds a prompt's tokens and pairs and saves none (and trees side by side cost no pairs between
    them).

    `marks`: for each sequence (`sequence_ids`: a row without turns is one, its prompt and completion; a row with
    turns one per turn, its context and tokens), a mark for each of its tokens, or None; two tokens merge only
    where their marks are equal too (an image's tokens, all one id, marked with which image and
    where in it: `grpo.learner.tree_images`). With `run_layers` (the layer types in which a model's image tokens
    attend each other both ways: Gemma 3's every layer, Gemma 4's sliding ones; `Tree.run_layers`), each run of
    marked tokens (an image's, where images never touch: `tree_images.marks`) attends itself both ways there: each
    of its keys is attended from the run's first token on (`Tree.first`)."""
    device = batch.prompt_ids.device
    pair_cost = 0.0 if kernel == "flex" else pair_cost
    max_width = max_width or MAX_WIDTH
    # laid out on the host (a few small tensors), moved to the batch's device at the end
    host = host_turns(batch)
    sequences: list[list[list]] = [[context + tokens for context, _, _, tokens in turns] for turns in host]
    numbers = sequence_ids([len(row) for row in sequences])
    if marks is not None:
        sequences = [
            [[t if m is None else (t, m) for t, m in zip(sequence, marks[n])] for sequence, n in zip(row, ns)]
            for row, ns in zip(sequences, numbers)
        ]
    groups: dict[int, list[int]] = {}
    for i, group in enumerate(batch.group.tolist()):
        groups.setdefault(group, []).append(i)
    alone = max(_Trie().added(rows) for rows in sequences)  # the widest row alone
    whole = [_Trie().added([s for i in rows for s in sequences[i]]) for rows in groups.values()]
    caps = {alone * 2**k for k in range(12) if alone * 2**k < max_width} | {max(alone, max_width)}
    caps |= {w for w in whole if alone <= w <= max_width}
    best: tuple[float, list[_Placed], list[list[int]], int] | None = None
    for cap in sorted(caps):
        trees = _cut(groups, sequences, numbers, cap)
        sizes = [len(trie) for trie, _ in trees]
        width = max(sizes)
        rows = _pack(sizes, width)
        cost = sum(sizes) + pair_cost * len(rows) * width * width
        if best is None or cost < best[0]:
            best = (cost, trees, rows, width)
    assert best is not None
    _, trees, rows, width = best
    c = batch.completion_ids.shape[1]
    row = np.zeros((len(batch), c), dtype=np.int64)
    column = np.zeros((len(batch), c), dtype=np.int64)
    # any id will do at the padding: no real token attends to it and its outputs are never read
    input_ids = np.full((len(rows), width), int(batch.prompt_ids[0, 0]), dtype=np.int64)
    positions = np.zeros((len(rows), width), dtype=np.int64)
    real = np.zeros((len(rows), width), dtype=np.int64)
    origin = np.zeros((len(rows), width), dtype=np.int64)
    last = np.tile(np.arange(width, dtype=np.int64), (len(rows), 1))  # padding sees itself: no empty softmax
    first = last.copy()
    for r, placed_trees in enumerate(rows):
        offset = 0
        for t in placed_trees:
            trie, placed = trees[t]
            place, subtree_last = trie.preorder()
            columns = offset + place  # each node's column
            input_ids[r, columns] = trie.tokens
            positions[r, columns] = trie.depth
            real[r, columns] = 1
            origin[r, columns] = trie.origin
            last[r, columns] = offset + subtree_last
            if run_layers:
                first[r, columns] = columns[trie.runs()]
            for i, nodes in placed.items():
                row[i] = r
                for (context, start, end, _), sequence, seen in zip(host[i], sequences[i], nodes):
                    # token t of a turn is predicted by the node before it: the context's last token for the first
                    column[i, start:end] = columns[seen[len(context) - 1 : len(sequence) - 1]]
            offset += len(trie)
    return Tree(
        input_ids=torch.from_numpy(input_ids).to(device=device, dtype=batch.prompt_ids.dtype),
        positions=torch.from_numpy(positions).to(device),
        real=torch.from_numpy(real).to(device),
        origin=torch.from_numpy(origin).to(device),
        first=torch.from_numpy(first).to(device),
        last=torch.from_numpy(last).to(device),
        row=torch.from_numpy(row).to(device),
        column=torch.from_numpy(column).to(device),
        kernel=kernel,
        run_layers=tuple(run_layers) if run_layers else None,
    )


def padded_shape(batch: TrainBatch, shared: bool) -> tuple[int, int]:
    """The positions and the (query, key) pairs the padded pass over `batch` computes: each row's prompt (each
    distinct prompt once where it is `shared` through a KV cache) and its completion, padded to the widest."""
    rows, prompt = batch.prompt_ids.shape
    width = int(batch.completion_attention.sum(-1).max())
    if not shared:
        return rows * (prompt + width), rows * (prompt + width) ** 2
    groups = len(shared_prompts(batch)[0])  # the distinct prompts the shared pass runs
    return groups * prompt + rows * width, groups * prompt * prompt + rows * width * (prompt + width)


def padded_cost(batch: TrainBatch, shared: bool, pair_cost: float) -> float:
    """`layout`'s cost of the padded pass over `batch` (`padded_shape`): its positions, and its pairs at
    `pair_cost`."""
    positions, pairs = padded_shape(batch, shared)
    return positions + pair_cost * pairs


def cost(trees: Tree, pair_cost: float) -> float:
    """`layout`'s cost of the trees: their positions, and their (query, key) pairs at `pair_cost`."""
    return trees.positions_computed + pair_cost * trees.pairs_computed


def cheaper(trees: Tree, batch: TrainBatch, shared: bool, pair_cost: float) -> bool:
    """Whether the trees cost less than the padded pass over `batch` (`padded_cost`) by `layout`'s measure."""
    return cost(trees, pair_cost) < padded_cost(batch, shared, pair_cost)


def longest(batch: TrainBatch) -> int:
    """The longest sequence a row's tokens are scored in: its prompt and completion, or with turns (`contexts`) a
    turn's context and tokens."""
    prompts = batch.prompt_mask.sum(-1).tolist()
    lengths = batch.completion_attention.sum(-1).tolist()
    if batch.turns is None:
        return int(max(p + n for p, n in zip(prompts, lengths)))
    return max(
        len(context) + end - start
        for i in range(len(batch))
        for context, start, end in contexts(batch, i, [0] * int(prompts[i]), int(lengths[i]))
    )


def fits_window(model: Any, batch: TrainBatch) -> bool:
    """Whether every row's whole sequence fits each of the model's windows (`windows`: its sliding attention window,
    Llama 4's chunks of positions, GPT-Neo's local band, ...); always, without one: a prepared mask replaces the
    model's own, which only differs from causal past the window or the first chunk."""
    bounds = model_windows.windows(model).values()
    return not bounds or longest(batch) <= min(bounds)


def forked(batch: TrainBatch) -> tuple[TrainBatch, torch.Tensor, torch.Tensor]:
    """A batch with turns (`TrainBatch.turns`) as one row per turn: the turn's context as its prompt, its tokens as
    its completion (what the other trainers call forked rows); and for each completion position of `batch` the
    forked row and column that hold it. Rows of the same context share a group (a prompt pass shares them)."""
    c = batch.completion_ids.shape[1]
    where_row = torch.zeros(len(batch), c, dtype=torch.long)
    where_column = torch.zeros(len(batch), c, dtype=torch.long)
    prompts: list[list[int]] = []
    completions: list[list[int]] = []
    groups: dict[tuple[int, ...], int] = {}
    group: list[int] = []  # each forked row's group: the index of its context
    for i, turns in enumerate(host_turns(batch)):
        for context, start, end, tokens in turns:
            where_row[i, start:end] = len(prompts)
            where_column[i, start:end] = torch.arange(end - start)
            prompts.append(context)
            completions.append(tokens)
            group.append(groups.setdefault(tuple(context), len(groups)))
    pad = int(batch.prompt_ids[0, 0])
    ids, mask = left_pad(prompts, pad)
    attention = right_pad([[1] * len(x) for x in completions], 0)
    device = batch.prompt_ids.device
    part = TrainBatch(
        prompt_ids=ids.to(device),
        prompt_mask=mask.to(device),
        completion_ids=right_pad(completions, pad).to(device),
        completion_attention=attention.to(device),
        mask=attention.float().to(device),
        advantages=torch.zeros(len(prompts), device=device),
        sampling_logps=torch.zeros(attention.shape, device=device),
        group=torch.tensor(group, device=device),
    )
    return part, where_row.to(device), where_column.to(device)


def default_packing(model: Any) -> str:
    """`packing=None`'s layout for `model`: "auto" where it trains on the CPU, where "auto" was at least as fast as
    the padded rows on every workload measured (bench/RESULTS.md: the demo 1.33x in bfloat16 and 2.47x with gradient
    checkpointing; long even completions the padded rows' own speed); "padded" on other devices, until the GPU
    check's `train_layouts` measures "auto" there."""
    parameter = next(unwrap(model).parameters(), None)
    return "auto" if parameter is None or parameter.device.type == "cpu" else "padded"


def unsupported_reason(model: Any) -> str | None:
    """Why this model's training pass cannot take a tree (None when it can)."""
    inner = unwrap(model)
    config = inner.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in _MASKED:
        return f"its attention ({implementation}) does not take a prepared 4D mask; use 'sdpa' or 'eager'"
    if getattr(config, "is_encoder_decoder", False):
        return "the model is an encoder-decoder"
    if keeps_recurrent_state(inner):
        return "the model has recurrent layers, whose state follows the token order, not the tree"
    return None
