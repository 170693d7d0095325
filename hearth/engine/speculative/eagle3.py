"""EAGLE-3 proposer: a one-layer draft head over the target's own hidden states.

Each target step, the runner captures the residual stream at the head's three layers for every
token it computes (`ModelRunner.capture_aux_hidden`; nothing is captured with any other
method); `computed` files those rows per request by position. Before the next step, `propose`
feeds the head the rows of every position the request has since computed (the rows of
rejected drafts are cut off first), appending the head's K/V for them to the request's own
head KV. Then it chains k - 1 single-token head steps on the head's own pre-norm output (all
requests batched), whose K/V are written past the kept ones and overwritten later. The drafts
are greedy and verified by the engine's usual step (hearth/engine/step.py), so the output is
the target's.

    position p:   ...   m-2          m-1        |  m            m+1
    head reads:   ...   h(m-2),x(m-1) h(m-1),x(m) |  h'(m-1),d1   h'(m),d2
    predicts:     ...   x(m)         d1         |  d2           d3

(m: the request's computed tokens, x(m) its newest token; h: the target's captured rows, h':
the head's pre-norm output of the row before.) The head's KV is one growable
[positions, kv_heads, head_dim] pair per request, apart from the target's pool. Positions the
target never computed here (a prefix-cache hit, KV imported from a prefill worker) have no
hidden states, so the head attends only from the first position it saw: less acceptance,
never a different output.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch

from hearth.config import SpeculativeConfig
from hearth.engine.request import Request
from hearth.models.eagle3_head import load_head

log = logging.getLogger("hearth.engine")
FOLD_ROWS = 256  # pending rows past this are folded into the head's KV without drafting
HEAD_KV_ROWS = 64  # a request's head KV starts with room for this many positions (it doubles)


@dataclass
class _HeadState:
    """One request's head KV (positions [start, start + n)) and the target rows not yet fed
    to the head (positions [start + n, start + n + len(rows)))."""

    start: int
    # [capacity, kv_heads, head_dim]: rows [0, n) hold positions [start, start + n); rows past
    # n the last chain of drafts' K/V, overwritten by the next
    k: torch.Tensor
    v: torch.Tensor
    n: int = 0
    rows: list[torch.Tensor] | None = None  # [q_i, 3H] pieces, in position order
    num_rows: int = 0

    @property
    def rows_start(self) -> int:
        return self.start + self.n

    @property
    def end(self) -> int:
        return self.start + self.n + self.num_rows

    def cut(self, position: int) -> bool:
        """Forget everything at `position` and after; False when nothing before it is left."""
        if position <= self.start:
            return False
        if position < self.rows_start:
            self.n, self.rows, self.num_rows = position - self.start, [], 0
        elif position < self.end:
            keep = position - self.rows_start
            joined = torch.cat(self.rows)[:keep]
            self.rows, self.num_rows = [joined], keep
        return True

    def reserve(self, rows: int) -> None:
        """Room for `rows` positions of K/V. Every row is kept: the committed ones, and those
        of a chain of drafts under way (past n, read by the chain's later drafts)."""
        if rows > self.k.shape[0]:
            cap = max(rows, 2 * self.k.shape[0])
            self.k = _grown(self.k, cap)
            self.v = _grown(self.v, cap)

    def append_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        need = self.n + k.shape[0]
        self.reserve(need)
        self.k[self.n : need] = k
        self.v[self.n : need] = v
        self.n = need


def _unwritten(rows: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Head K/V rows not yet written: NaN, so a read of one (a bug) makes that draft's
    attention NaN every time instead of reading whatever memory held (torch.empty)."""
    return torch.full((rows, kv_heads, head_dim), float("nan"))


def _grown(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = _unwritten(rows, *t.shape[1:])
    out[: t.shape[0]] = t
    return out


class Eagle3Proposer:
    name = "eagle3"

    def __init__(self, config: SpeculativeConfig, executor) -> None:
        capture = getattr(executor, "capture_aux_hidden", None)
        if capture is None:
            raise ValueError("speculative_method eagle3: needs the model in this process "
                             "(tensor and pipeline parallel size 1)")
        model = executor.model
        if "aux" not in inspect.signature(model.forward).parameters:
            raise ValueError(f"speculative_method eagle3: {type(model).__name__} cannot hand "
                             f"out its hidden states (its forward takes no `aux`)")
        self.head = load_head(config.draft_model, model.arch, model.embed_tokens)
        capture(self.head.spec.aux_layer_ids)
        self.runner = executor
        self.states: dict[str, _HeadState] = {}
        self.indexes: dict = {}  # (the n-gram proposers' per-request state; none here)

    # ---- the target's rows -------------------------------------------------------------------
    @torch.inference_mode()
    def computed(self, requests: list[Request], query_lens: list[int], context_lens: list[int],
                 skip: set[str] = frozenset()) -> list[str]:
        """The runner just computed `query_lens[i]` tokens of `requests[i]` ending at
        `context_lens[i]`: file their captured rows (but not those of the requests in `skip`).
        Returns the ids of the requests whose rows could not be filed (state dropped)."""
        aux = self.runner.aux_hidden  # [num_tokens, 3H]
        if aux is None:
            return []
        failed, offset = [], 0
        for req, q, end in zip(requests, query_lens, context_lens):
            if req.request_id in skip:
                offset += q
                continue
            try:
                self.file_rows(req, aux[offset : offset + q], end - q)
            except Exception:
                log.exception("eagle3: filing the hidden states of %s failed", req.request_id)
                self.drop(req.request_id)
                failed.append(req.request_id)
            offset += q
        return failed

    def file_rows(self, req: Request, rows: torch.Tensor, start: int) -> None:
        """`rows` [q, 3H]: the target's hidden states of `req` at positions [start, start + q)."""
        state = self.states.get(req.request_id)
        if state is not None and (start > state.end or not state.cut(start)):
            state = None  # a gap, or recomputed from before the head's first position
        if state is None:
            s = self.head.spec
            state = self.states[req.request_id] = _HeadState(
                start, _unwritten(HEAD_KV_ROWS, s.num_kv_heads, s.head_dim),
                _unwritten(HEAD_KV_ROWS, s.num_kv_heads, s.head_dim), rows=[], num_rows=0)
        state.rows.append(rows)
        state.num_rows += rows.shape[0]
        if state.num_rows > FOLD_ROWS and start > state.rows_start:
            # rows before this step's are the request's computed tokens: feed them now
            self._feed(state, req.all_token_ids, start)

    # ---- drafting ----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_many(self, wants: list[tuple[Request, int]]) -> list[list[int]]:
        """Each request's pending rows through the head (one forward per request: their
        lengths differ), then the k - 1 chained steps of all requests batched (attention per
        request, over its own head KV)."""
        drafts: list[list[int]] = [[] for _ in wants]
        live = []  # (index in wants, state, k, m)
        normed_rows, prenorm_rows = [], []
        for i, (req, k) in enumerate(wants):
            state = self.states.get(req.request_id)
            m = req.num_computed_tokens
            if (state is None or not state.cut(m) or state.end < m or state.num_rows == 0
                    or m + k > self.head.spec.max_position_embeddings):
                continue  # no hidden states for the request's last computed token
            normed, prenorm = self._feed(state, req.all_token_ids, m)
            live.append((i, state, k, m))
            normed_rows.append(normed)
            prenorm_rows.append(prenorm)
        if not live:
            return drafts
        for _, state, k, _ in live:  # room for the whole chain now: no growth under way
            state.reserve(state.n + k - 1)
        tokens = self.head.draft_ids(torch.cat(normed_rows))  # [B]
        prenorm = torch.cat(prenorm_rows)  # [B, H]
        for j in range(1, max(k for _, _, k, _ in live) + 1):
            for (i, _, _, _), token in zip(live, tokens.tolist()):
                drafts[i].append(token)  # draft j
            keep = [b for b, (_, _, k, _) in enumerate(live) if k > j]
            if not keep:
                break
            if len(keep) < len(live):
                live = [live[b] for b in keep]
                tokens, prenorm = tokens[keep], prenorm[keep]
            # draft j sits at position m - 1 + j; its K/V go past the request's committed ones
            positions = torch.tensor([m - 1 + j for _, _, _, m in live])
            q, k_new, v_new, residual = self.head.qkv_of(tokens, prenorm, positions)
            attn = []
            for b, (_, state, _, _) in enumerate(live):
                end = state.n + j  # (reserved above)
                state.k[end - 1], state.v[end - 1] = k_new[b], v_new[b]
                attn.append(self._attend(q[b : b + 1], state.k[:end], state.v[:end]))
            normed, prenorm = self.head.after_attention(torch.cat(attn), residual)
            tokens = self.head.draft_ids(normed)
        return drafts

    def propose(self, req: Request, k: int) -> list[int]:
        return self.propose_many([(req, k)])[0]

    def _feed(self, state: _HeadState, tokens: list[int], upto: int):
        """Run the head over the pending rows of positions [rows_start, upto), keeping their
        K/V; returns the last row's (normed, pre-norm) outputs, [1, H] each. One layer: a
        row's K/V depend on its inputs only, so only the last row attends (over every kept
        position, all at or before its own) and goes through the MLP."""
        first = state.rows_start
        num = upto - first
        rows = torch.cat(state.rows)
        pending, rest = rows[:num], rows[num:]
        ids = torch.tensor(tokens[first + 1 : upto + 1])  # the token after each position
        positions = torch.arange(first, upto)
        q, k, v, residual = self.head.qkv_of(ids, self.head.combine(pending), positions)
        state.append_kv(k, v)
        state.rows, state.num_rows = [rest], rest.shape[0]
        return self.head.after_attention(
            self._attend(q[-1:], state.k[: state.n], state.v[: state.n]), residual[-1:])

    def _attend(self, q, keys, values) -> torch.Tensor:
        """q [1, heads, D] (at or after every key's position), keys/values [S, kv_heads, D]
        -> [1, heads * D]. One query: two small einsums (torch's SDPA took ~20 ms here)."""
        s = self.head.spec
        q = q.view(s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim)
        scores = torch.einsum("hgd,shd->hgs", q, keys) * s.head_dim ** -0.5
        out = torch.einsum("hgs,shd->hgd", scores.softmax(dim=-1), values)
        return out.reshape(1, -1)

    # ---- lifetime ----------------------------------------------------------------------------
    def drop(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def finished(self, req: Request) -> None:
        self.drop(req.request_id)

    def close(self) -> None:
        self.states.clear()
        self.runner.capture_aux_hidden(())
