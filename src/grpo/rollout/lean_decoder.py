"""A lean forward pass for sampling from Llama-family models (Llama, Mistral, Qwen2, Qwen3, SmolLM2 and 3, Phi-3,
OLMo 2) and Gemma 3.

Decoding a 135M model on a CPU spends most of each token in framework overhead: a transformers forward runs
~500 small operators per token (module calls, per-projection matmuls, a growing KV cache concatenated each
step, mask construction). `LeanDecoder` runs the same arithmetic with fewer, larger operators:
- the q/k/v projections are one matmul and gate/up are one matmul (weights concatenated once per rollout, or
  packed from their parts by the panel kernel);
- each weight is cast to the compute dtype once per rollout (bfloat16 under autocast) and, on CPUs with
  oneDNN, pre-packed for its matmul kernel;
- keys and values go into buffers written in place, grown by `GROW` columns as the tokens come (never sized
  for a budget the rows do not use); finished rows are dropped from them layer by layer (one layer's copy at a
  time, never the whole cache twice);
- in float32 on a CPU (no fast bfloat16), for a rollout whose budget runs on, every linear and the output head
  go to grpo's panel kernel from the prefill on (`grpo.rollout.cpu.panels`: x86 with AVX2 and FMA, and a C
  compiler), whose layout serves any row count, so finished rows are dropped as on the plain path; and each
  decode step runs every layer in one C call (`panels.decode_layers`: the same operations as `_forward`, where
  ~35 torch operators a layer cost more than their arithmetic at a few rows). Elsewhere
  with MKL, the MLP weights and the head are packed for MKL's sgemm at the decode batch's row count, at least
  `packed.MIN_ROWS` slots (`grpo.rollout.cpu.packed`; `PACKED` says why not the attention projections). The batch
  then keeps its finished rows' slots (fed their last token, their logits unread), since that layout serves one
  row count; once half its slots are free it is repacked for the rows left (at least `packed.MIN_ROWS`), and a
  last row alone leaves for the plain matrix-vector product.
The numbers follow the transformers forward under autocast: float32 residual stream and RMSNorm, matmuls on
bfloat16 inputs and weights with bfloat16 outputs, rotary embedding from the model's own rotary module, attention
over bfloat16 keys and values. Qwen3's per-head RMSNorm of queries and keys (`q_norm`, `k_norm`) runs before the
rotation, as there: float32 statistics, the result rounded to the compute dtype, then times the norm's weight. The
tests compare next-token distributions against the transformers forward.

Gemma 3's text model runs the same loop with its own layer: embeddings times sqrt(hidden), RMSNorms of (1 + weight)
before and after each sublayer, queries scaled by `query_pre_attn_scalar`, the tanh GELU, sliding layers (keys at
most `sliding_window` - 1 positions back, by position, not column: rows are left-padded) rotated at their own base
beside full ones, and the final soft-capping where configured. Sliding windows of the Llama family (Mistral's on
every layer, Qwen2's past `max_window_layers`, Qwen3's and SmolLM3's by layer type) are masked the same way, and
SmolLM3's layers without rotary embeddings are not rotated. Phi-3's fused q/k/v and gate/up linears are the
decoder's own stacked parts, and its partial rotation turns each head's first dimensions (Phi-3 without either
takes the fused step like Llama). OLMo 2 norms each sublayer's output instead of its input, and its query and key
projections whole. Gemma 3, OLMo 2, windows, layers without RoPE and partial rotations take the per-operator
path (the fused C step and the fixed-shape loop run the Llama layer: `lean_families.fixed_shape_reason`).

For the fixed-shape loop the decoder takes every weight its step reads from the engine's `held.HeldWeights`: tensors
at addresses that last the run, refreshed in place at each rollout, so that the CUDA graphs captured on them are
replayed in every later rollout.

A LoRA policy (PEFT) runs here too: each rollout's weights are the merged copies (`lora.merged_linear`: base +
scaling * B A of the active adapters, summed in float32 and rounded once by the cast above; `modules_to_save`
copies in place of their originals), never merged into the policy. Models it does not recognise, or only half (other
wrapped projections: DoRA, quantized layers; a quantization config, a rotary type it does not know, other norms, a
parameter it would not read), keep the transformers forward (`lean_families.unsupported_reason` says why). The
layers' arithmetic, family by family, is in `lean_ops`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from grpo.models import lora
from grpo.models.fp32_head import is_fp32_head
from grpo.models.lora import active_module
from grpo.models.modeling import unwrap
from grpo.perf.kernels import Linear, fixed_linear
from grpo.rollout import lean_families
from grpo.rollout.cpu import packed, panels
from grpo.rollout.held import HeldWeights, cast_stacked
from grpo.rollout.lean_families import layer_norms, norm_eps
from grpo.rollout.lean_ops import gemma_norm, grouped_attention, head_norms, llama_norm, olmo_norm, rotated, same

# the linears packed for MKL (with the head): packing qkv and o too costs several times their weights' memory for a
# few percent of a step (`bench/RESULTS.md`)
PACKED = ("gate_up", "down")
PANELS = ("qkv", "o", "gate_up", "down")  # the panel kernel's layout is the weight's own size: all of them
GROW = 128  # key/value columns added at a time: the cache grows with the tokens the rows have
FUSED = True  # a float32 decode step on the panel kernel runs every layer in one call (`panels.decode_layers`)


class LeanDecoder:
    """The model's forward for sampling: `prefill` the prompts, then `step` one token at a time, `select` rows."""

    def __init__(self, model: Any, dtype: torch.dtype, held: HeldWeights | None = None) -> None:
        model = unwrap(model)
        config, inner = model.config, model.model
        self.dtype = dtype
        self.held = held  # the fixed-shape loop's weights, kept for the run; None: this rollout's own
        self.gemma = config.model_type in lean_families.GEMMA
        self.olmo = config.model_type in lean_families.OLMO
        embed = active_module(inner.embed_tokens)
        self.embed = self._held("embed", [embed.weight], embed.weight.dtype)
        # Gemma scales its embeddings (by sqrt(hidden), in the weight's dtype): None for the others
        self.embed_scale = getattr(embed, "embed_scale", None) if self.gemma else None
        self.rotary = inner.rotary_emb
        if held is not None and isinstance(getattr(self.rotary, "inv_freq", None), torch.Tensor):
            held.watch("rotary.inv_freq", self.rotary.inv_freq)  # read by the model's module: its address is watched
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.hidden = config.hidden_size
        scalar = getattr(config, "query_pre_attn_scalar", None) if self.gemma else None
        self.scale = (scalar or self.head_dim) ** -0.5
        self.softcap = getattr(config, "final_logit_softcapping", None) if self.gemma else None
        self.partial_rotary = getattr(config, "partial_rotary_factor", None) not in (None, 1.0)  # Phi-3's
        self.layers = []
        # per layer, each linear's weight parts and bias: q/k/v and gate/up are one matmul each, their weights
        # stacked by rows (by the panel kernel's packing, or concatenated once the plain path needs them). A LoRA
        # layer's weight is its merged copy (`lora.merged_linear`), made here for this rollout.
        self.parts: list[dict[str, tuple[list[torch.Tensor], torch.Tensor | None]]] = []
        for index, layer in enumerate(inner.layers):
            a, m = layer.self_attn, layer.mlp
            if hasattr(a, "qkv_proj"):  # Phi-3: q, k and v already one linear
                qkv = _listed(lora.merged_linear(a.qkv_proj, dtype))
            else:
                (wq, bq), (wk, bk), (wv, bv) = (lora.merged_linear(p, dtype) for p in (a.q_proj, a.k_proj, a.v_proj))
                qkv = ([wq, wk, wv], _stacked_bias([(wq, bq), (wk, bk), (wv, bv)]))
            if hasattr(m, "gate_up_proj"):  # Phi-3: gate and up one linear (gate first)
                gate_up = _listed(lora.merged_linear(m.gate_up_proj, dtype))
            else:
                (wg, bg), (wu, bu) = lora.merged_linear(m.gate_proj, dtype), lora.merged_linear(m.up_proj, dtype)
                gate_up = ([wg, wu], _stacked_bias([(wg, bg), (wu, bu)]))
            self.parts.append(
                dict(
                    qkv=qkv,
                    o=_listed(lora.merged_linear(a.o_proj, dtype)),
                    gate_up=gate_up,
                    down=_listed(lora.merged_linear(m.down_proj, dtype)),
                )
            )
            after: tuple[Any, Any, Any] | None
            if self.olmo:  # no norm before a sublayer: its output is normed
                before: dict[str, Any] = dict(norm1=same, norm2=same, norm1_weight=None, norm2_weight=None)
                after = (olmo_norm, layer.post_attention_layernorm, layer.post_feedforward_layernorm)
            else:
                norm1, norm2 = (active_module(n) for n in layer_norms(layer, self.gemma))
                if self.gemma:
                    before = dict(norm1=gemma_norm(norm1), norm2=gemma_norm(norm2))
                else:
                    w1, w2 = (
                        self._held(f"{index}.{k}", [n.weight], n.weight.dtype)
                        for k, n in (("norm1", norm1), ("norm2", norm2))
                    )
                    before = dict(norm1=llama_norm(norm1, w1), norm2=llama_norm(norm2, w2))
                before.update(norm1_weight=norm1.weight, norm2_weight=norm2.weight)
                after = (
                    (gemma_norm, layer.post_attention_layernorm, layer.post_feedforward_layernorm)
                    if self.gemma
                    else None
                )
            self.layers.append(
                dict(
                    qk_norm=None if self.olmo else self._held_norms(index, a),
                    # OLMo 2: the query and key projections each RMS-normed whole, before the heads are split
                    projection_norms=(olmo_norm(active_module(a.q_norm)), olmo_norm(active_module(a.k_norm)))
                    if self.olmo
                    else None,
                    **before,
                    # Gemma and OLMo 2: each sublayer's output RMS-normed before it joins the residual stream
                    post_attn=after[0](active_module(after[1])) if after else None,
                    post_mlp=after[0](active_module(after[2])) if after else None,
                    # a sliding layer's window: keys at most window - 1 positions before the query
                    window=lean_families.window(a, config),
                    rope=bool(getattr(a, "use_rope", True)),  # SmolLM3's layers without rotary embeddings
                    rotary_type=getattr(a, "layer_type", None) if self.gemma else None,
                    intermediate=sum(w.shape[0] for w in gate_up[0]) // 2,
                )
            )
        self.eps = {
            norm_eps(active_module(n)) for layer in inner.layers for n in layer_norms(layer, self.gemma, self.olmo)
        }
        final = active_module(inner.norm)
        self.norm = (
            gemma_norm(final)
            if self.gemma
            else llama_norm(final, self._held("norm", [final.weight], final.weight.dtype))
        )
        self.windows = sorted({layer["window"] for layer in self.layers if layer["window"]})
        self.key_positions: torch.Tensor | None = None  # with windows: each key column's position (rows, width)
        head = active_module(model.lm_head)
        self.head_dtype = torch.float32 if is_fp32_head(head) else dtype  # cast_lm_head_to_fp32
        self.head_weights = lora.merged_linear(head, self.head_dtype)
        self.head: Linear | None = None
        self.plain: tuple[list[dict[str, Linear]], Linear] | None = None  # the plain linears (`_unpack`), once made
        self.stacked: list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]] | None = None  # `_plain_weights`
        self.in_panels = False  # whether the linears are the panel kernel's (for the whole rollout)
        self.fused: Any = None  # with the panels: every layer of a decode step in one call (`panels.decode_layers`)
        self.unpacked = False  # whether the linears are packed (MKL) or in panels, not the plain ones
        self.slots = 0  # rows of the packed batch
        self.live: torch.Tensor | None = None  # while packed: each row's slot in the batch (finished rows stay)
        self.fed: torch.Tensor | None = None  # while packed: the token each slot was fed last
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.positions: torch.Tensor | None = None
        self.steps = self.max_new = 0  # decode steps run, of at most max_new

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, owner: torch.Tensor, max_new: int) -> torch.Tensor:
        """Run the (left-padded) unique prompts once, copy their keys and values to the rows that share them
        (`owner[row]` = its prompt) and leave room for the first of `max_new` tokens (the buffers grow by `GROW`
        columns as the rows need them). Returns each row's next-token logits."""
        self.steps, self.max_new = 0, max_new
        if self._budget_left(packed.STEPS_AFTER_PACKING) and self._panels_available():
            self._panels()  # the prefill too: its rows (up to panels.MAX_ROWS) take the panel kernel
        else:
            self._unpack()
        logits = self.prompt_pass(ids, mask, ids.shape[1] + min(max_new, GROW))
        self.select(owner)
        self.positions = mask.sum(-1, keepdim=True)[owner]
        return logits[owner]

    def prompt_pass(self, ids: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
        """The prompts' forward into key/value buffers `width` columns wide (the first ids.shape[1] filled);
        returns each prompt's next-token logits."""
        u, p = ids.shape
        shape = (u, self.kv_heads, width, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=ids.device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=ids.device) for _ in self.layers]
        self.valid = torch.zeros(u, width, dtype=torch.bool, device=ids.device)
        self.valid[:, :p] = mask.bool()
        self.length = 0
        self.positions = None
        causal = torch.ones(p, p, dtype=torch.bool, device=ids.device).tril()
        # a padding query attends to itself only (its output is never used; an all-masked row would be NaN)
        eye = torch.eye(p, dtype=torch.bool, device=ids.device)
        attend = (self.valid[:, None, None, :p] & causal) | eye
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        masks: dict[int | None, torch.Tensor] = {None: attend}
        self.key_positions = None
        if self.windows:  # a sliding layer's keys: at most window - 1 positions before the query's
            self.key_positions = torch.zeros(u, width, dtype=torch.long, device=ids.device)
            self.key_positions[:, :p] = positions
            back = positions[:, :, None] - positions[:, None, :]
            for window in self.windows:
                masks[window] = (attend & (back < window)[:, None]) | eye
        return self._forward(ids, positions, masks, decode=False)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row; returns the next-token logits (rows, vocab) in float32."""
        if self.steps == packed.PACK_AFTER and not self.in_panels and self._budget_left(packed.STEPS_AFTER_PACKING):
            # the rollout runs on, its budget far from spent
            self._pack(torch.arange(len(tokens), device=tokens.device))
        self.steps += 1
        if self.length == self.valid.shape[1]:
            self._grow(max(self.max_new - self.steps, 1))  # the calls left, this one included
        if self.live is not None:  # the packed batch: a finished row's slot repeats its last token, unread
            assert self.fed is not None  # set with live
            tokens = self.fed = self.fed.index_copy(0, self.live, tokens)
        self.valid[:, self.length] = True
        assert self.positions is not None, "prefill first"
        masks: dict[int | None, torch.Tensor] = {None: self.valid[:, None, None, : self.length + 1]}
        if self.windows:
            assert self.key_positions is not None  # set by the prompt pass
            self.key_positions[:, self.length] = self.positions[:, 0]
            back = self.positions - self.key_positions[:, : self.length + 1]
            for window in self.windows:
                masks[window] = masks[None] & (back < window)[:, None, None]
        if self.dtype == torch.float32:  # one additive mask a kind of layer: 0 where a key is attended, -inf elsewhere
            masks = {k: torch.zeros(m.shape, device=m.device).masked_fill_(~m, float("-inf")) for k, m in masks.items()}
        logits = self._forward(tokens.unsqueeze(-1), self.positions, masks, decode=True)
        self.positions = self.positions + 1
        if self.live is not None and len(self.live) < self.slots:
            logits = logits.index_select(0, self.live)
        return logits

    def select(self, rows: torch.Tensor) -> None:
        """Keep these rows (in this order) of every buffer."""
        if self.live is not None:
            live = self.live[rows]
            if len(live) > 1:
                fewer = max(len(live), packed.MIN_ROWS)  # the slots a repack would leave
                if (
                    len(live) * 2 <= self.slots
                    and fewer < self.slots
                    and self._budget_left(packed.STEPS_AFTER_REPACKING)
                ):
                    self._pack(live, fewer)  # half the slots or more are free, with steps to come
                else:
                    self.live = live  # the packed batch stays whole
                return
            rows = live  # a last row: the plain matrix-vector product from here on
            self._unpack()
        self._keep(rows)

    def _keep(self, rows: torch.Tensor) -> None:
        # layer by layer, each old buffer freed as its copy is made: the cache is never held twice
        for cache in (self.keys, self.values):
            for i in range(len(cache)):
                cache[i] = cache[i].index_select(0, rows)
        self.valid = self.valid.index_select(0, rows)
        if self.key_positions is not None:
            self.key_positions = self.key_positions.index_select(0, rows)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, rows)

    def _grow(self, wanted: int) -> None:
        """`min(GROW, wanted)` more key/value columns, layer by layer (each old buffer freed as it is copied)."""
        more = min(GROW, wanted)
        self.valid = F.pad(self.valid, (0, more))
        if self.key_positions is not None:
            self.key_positions = F.pad(self.key_positions, (0, more))
        for cache in (self.keys, self.values):
            for i in range(len(cache)):
                cache[i] = F.pad(cache[i], (0, 0, 0, more))

    def _held(self, name: str, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """A weight the step reads: the run's held tensor for the fixed-shape loop, else the weight itself (one part)
        or the parts cast and stacked."""
        if self.held is not None:
            return self.held.take(name, parts, dtype)
        return parts[0] if len(parts) == 1 and parts[0].dtype == dtype else cast_stacked(parts, dtype)

    def _held_bias(self, name: str, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        return bias if bias is None or self.held is None else self.held.take(f"{name}.bias", [bias], dtype)

    def _held_norms(self, index: int, attn: Any) -> tuple[torch.Tensor, float, bool] | None:
        norms = head_norms(attn, self.heads, self.kv_heads, self.gemma)
        if norms is None or self.held is None:
            return norms
        table, eps, gemma = norms
        return self.held.take(f"{index}.qk_norm", [table], table.dtype), eps, gemma

    def _budget_left(self, steps: int) -> bool:
        return self.max_new - self.steps > steps

    def _pack(self, rows: torch.Tensor, slots: int | None = None) -> None:
        """Float32 on a CPU: the panel kernel where it runs (`_panels`); else, with MKL, the `PACKED` linears and
        the head packed for a batch of `slots` rows
        (`grpo.rollout.cpu.packed`; default and at least: as many as `rows`, and `packed.MIN_ROWS`), holding these
        `rows` of the batch (the other slots repeat the first row, their logits unread). A single row keeps the
        plain path."""
        if self.dtype != torch.float32 or len(rows) < 2 or not packed.available(self.head_weights[0]):
            return
        slots = max(slots or len(rows), packed.MIN_ROWS)
        fed = self.fed[rows] if self.fed is not None else torch.zeros(len(rows), dtype=torch.long, device=rows.device)
        self._unpack()  # the old layout's buffers go before the new ones are made
        self._keep(torch.cat([rows, rows[:1].expand(slots - len(rows))]))
        self.unpacked = True
        for layer, weights in zip(self.layers, self._plain_weights()):
            layer.update({k: packed.packed_linear(*weights[k], slots) for k in PACKED})
        self.head = packed.packed_linear(*self.head_weights, slots)
        self.slots, self.live = slots, torch.arange(len(rows), device=rows.device)
        self.fed = torch.cat([fed, fed[:1].expand(slots - len(rows))])

    def _panels_available(self) -> bool:
        """Float32 on a CPU where grpo's panel kernel runs (and a float32 head)."""
        return self.dtype == torch.float32 and self.head_dtype == torch.float32 and panels.available(self.embed)

    def _panels(self) -> None:
        """Every linear and the head on the panel kernel, for the whole rollout (any row count): packed from the
        weights' parts, nothing concatenated."""
        self.unpacked = self.in_panels = True
        self.live, self.fed, self.slots = None, None, 0
        for layer, parts in zip(self.layers, self.parts):
            layer.update({k: panels.panel_linear(*parts[k]) for k in PANELS})
        self.head = panels.panel_linear([self.head_weights[0]], self.head_weights[1])
        same = len(self.eps) == 1 and len({layer["intermediate"] for layer in self.layers}) == 1
        head_norms = [layer["qk_norm"] for layer in self.layers if layer["qk_norm"] is not None]
        # the C step takes query/key norms of the layers' epsilon, in float32, held contiguous
        same = same and all(
            eps in self.eps and t.dtype == torch.float32 and t.is_contiguous() for t, eps, _ in head_norms
        )
        llama = not (self.gemma or self.olmo or self.windows) and all(layer["rope"] for layer in self.layers)
        llama = llama and not self.partial_rotary  # the C step rotates whole heads
        if FUSED and same and llama and all(n.dtype == torch.float32 for n in self._norm_weights()):
            sizes = panels.Sizes(
                self.hidden,
                self.heads,
                self.kv_heads,
                self.head_dim,
                self.layers[0]["intermediate"],
                next(iter(self.eps)),
                self.scale,
            )
            self.fused = (panels.layer_table(self.layers), sizes)

    def _norm_weights(self) -> list[torch.Tensor]:
        return [layer[k] for layer in self.layers for k in ("norm1_weight", "norm2_weight")]

    def _plain_weights(self) -> list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]]:
        """Each layer's linears as (weight, bias) in the compute dtype, q/k/v and gate/up concatenated (made when the
        plain or MKL path needs them, once). Each part is cast before the concatenation: a bfloat16 rollout never
        holds a float32 copy of a weight (a 7B model's would be ~30 GB)."""
        if self.stacked is None:
            self.stacked = [
                {
                    k: (self._held(f"{i}.{k}", ws, self.dtype), self._held_bias(f"{i}.{k}", bias, self.dtype))
                    for k, (ws, bias) in layer.items()
                }
                for i, layer in enumerate(self.parts)
            ]
        return self.stacked

    def _unpack(self) -> None:
        """The plain linears (weights cast once for the rollout: `fixed_linear`), made on first use."""
        if self.plain is None:
            pack = self.held is None  # a held weight is read where it is (a packed copy would be made anew)
            head, bias = self.head_weights
            if self.held is not None:
                head, bias = self._held("head", [head], self.head_dtype), self._held_bias("head", bias, self.head_dtype)
                self.head_weights = (head, bias)
            self.plain = (
                [
                    {k: fixed_linear(w, b, self.dtype, pack=pack) for k, (w, b) in layer.items()}
                    for layer in self._plain_weights()
                ],
                fixed_linear(head, bias, self.head_dtype, pack=pack),
            )
            if self.held is not None:  # the held weights are all the step reads: LoRA's merged parts go now
                self.parts = []
        if self.unpacked or self.head is None:
            linears, self.head = self.plain
            for layer, plain in zip(self.layers, linears):
                layer.update(plain)
        self.unpacked = self.in_panels = False
        self.fused, self.live, self.fed, self.slots = None, None, None, 0

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, masks: dict[int | None, torch.Tensor], decode: bool
    ) -> torch.Tensor:
        """The layers over `ids` at `positions`, their keys and values written at the next columns; `masks` the
        attention mask of the full layers (None) and of each sliding window's layers. Returns the last token's
        logits."""
        assert self.head is not None  # made by prefill (`_panels` or `_unpack`)
        b, t = ids.shape
        start, end = self.length, self.length + t
        x = F.embedding(ids, self.embed)
        if self.embed_scale is not None:  # Gemma: times sqrt(hidden) in the weight's dtype
            x = x * self.embed_scale.to(x.dtype)
        x = x.float()
        rotations = {
            kind: self._rotation(x, positions, kind) for kind in {layer["rotary_type"] for layer in self.layers}
        }
        attend = masks[None]
        if decode and self.fused is not None:  # every layer in one call (not a one-token prompt's pass)
            table, sizes = self.fused
            cos, sin = rotations[None]
            x = x[:, 0].contiguous()
            mask = attend.reshape(b, end).contiguous()
            cos, sin = cos[:, 0, 0].contiguous(), sin[:, 0, 0].contiguous()
            panels.decode_layers(table, sizes, x, cos, sin, mask, self.keys, self.values, start)
            self.length = end
            return self.head(self.norm(x)).float()
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            cos, sin = rotations[layer["rotary_type"]]
            attend = masks[layer["window"]]
            qkv = layer["qkv"](layer["norm1"](x))
            qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
            if layer["projection_norms"] is not None:
                q_norm, k_norm = layer["projection_norms"]
                qk = torch.cat([q_norm(qk[..., :q_size]), k_norm(qk[..., q_size:])], dim=-1)
            # queries and keys rotated in one pass (the same arithmetic, element by element, as one each)
            qk = rotated(qk.view(b, t, self.heads + self.kv_heads, self.head_dim).transpose(1, 2), layer, cos, sin)
            q, k = qk.split([self.heads, self.kv_heads], dim=1)
            q = q.to(self.dtype)
            self.keys[i][:, :, start:end] = k
            self.values[i][:, :, start:end] = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            keys, values = self.keys[i][:, :, :end], self.values[i][:, :, :end]
            if t == 1 and attend.dtype == torch.float32:  # (bfloat16 keeps the kernel's float32 softmax)
                out = grouped_attention(q, keys, values, attend, self.scale)
            else:
                if not decode and keys.is_cuda and self.kv_heads != self.heads:
                    # a mask rules the flash kernel out; the memory-efficient one takes a mask but, in some torch
                    # builds, not grouped heads (the math kernel would hold every (query, key) score): the prompt
                    # pass repeats them, as transformers' training forward does
                    keys, values = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (keys, values))
                out = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=attend, scale=self.scale, enable_gqa=keys.shape[1] != self.heads
                )
            attended = layer["o"](out.transpose(1, 2).reshape(b, t, q_size))
            x = x + (attended if layer["post_attn"] is None else layer["post_attn"](attended))
            gate, up = layer["gate_up"](layer["norm2"](x)).split(layer["intermediate"], dim=-1)
            mixed = layer["down"]((F.gelu(gate, approximate="tanh") if self.gemma else F.silu(gate)) * up)
            x = x + (mixed if layer["post_mlp"] is None else layer["post_mlp"](mixed))
        self.length = end
        logits = self.head(self.norm(x[:, -1])).float()
        if self.softcap is not None:  # Gemma's final soft-capping, where configured
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _rotation(
        self, x: torch.Tensor, positions: torch.Tensor, kind: str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) at `positions`, (rows, 1, tokens, head_dim) in float32, of the layers of rotary `kind` (Gemma
        3 rotates its sliding layers at another base: its rotary module takes the layer type)."""
        cos, sin = self.rotary(x, positions) if kind is None else self.rotary(x, positions, kind)
        return cos.unsqueeze(1).float(), sin.unsqueeze(1).float()


def _stacked_bias(linears: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor | None:
    """The bias of linears stacked by rows: None where none has one, else theirs (zeros for one without)."""
    if all(bias is None for _, bias in linears):
        return None
    return torch.cat([bias if bias is not None else weight.new_zeros(weight.shape[0]) for weight, bias in linears])


def _listed(linear: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    return [linear[0]], linear[1]
