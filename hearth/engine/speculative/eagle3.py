"""EAGLE-3 proposer: a one-layer draft head over the target's own hidden states.

Each target step, the runner captures the residual stream at the head's three layers for every
token it computes (`ModelRunner.capture_aux_hidden`; nothing is captured with any other
method); `computed` files those rows per request by position. Before the next step, `propose`
feeds the head the rows of every position the request has since computed (the rows of
rejected drafts are cut off first), appending the head's K/V for them to the request's own
head KV, and chains k - 1 more single-token head steps on its own pre-norm output, whose K/V
are thrown away afterwards. Verification is the engine's usual one (hearth/engine/step.py):
the drafts are greedy, so the output is the target's.

    position:        ...  m-2     m-1  |  m      m+1      (m = the request's computed tokens)
    head input:      h_{m-2}+x_{m-1}  h_{m-1}+x_m  |  h'+d_1  h'+d_2 ...
    predicts:        x_m      d_1      |  d_2    d_3

The head's KV lives here, one growable [positions, kv_heads, head_dim] pair per request (it
shares nothing with the target's pool). Positions the target never computed here (a prefix
cache hit, KV imported from a prefill worker) have no hidden states: the head then attends
only from the first position it saw. That costs acceptance, never exactness.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hearth.config import SpeculativeConfig
from hearth.engine.request import Request
from hearth.models.eagle3_head import load_head

log = logging.getLogger("hearth.engine")
FOLD_ROWS = 256  # pending rows past this are folded into the head's KV without drafting


@dataclass
class _HeadState:
    """One request's head KV (positions [start, start + n)) and the target rows not yet fed
    to the head (positions [start + n, start + n + len(rows)))."""

    start: int
    k: torch.Tensor  # [capacity, kv_heads, head_dim]
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

    def append_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        need = self.n + k.shape[0]
        if need > self.k.shape[0]:
            cap = max(need, 2 * self.k.shape[0])
            self.k = _grown(self.k, cap)
            self.v = _grown(self.v, cap)
        self.k[self.n : need] = k
        self.v[self.n : need] = v
        self.n = need


def _grown(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = t.new_empty((rows, *t.shape[1:]))
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
            empty = torch.empty(64, s.num_kv_heads, s.head_dim)
            state = self.states[req.request_id] = _HeadState(start, empty, empty.clone(),
                                                             rows=[], num_rows=0)
        state.rows.append(rows)
        state.num_rows += rows.shape[0]
        if state.num_rows > FOLD_ROWS and start > state.rows_start:
            # rows before this step's are the request's computed tokens: feed them now
            self._feed(state, req.all_token_ids, start)

    # ---- drafting ----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_many(self, wants: list[tuple[Request, int]]) -> list[list[int]]:
        return [self.propose(req, k) for req, k in wants]

    @torch.inference_mode()
    def propose(self, req: Request, k: int) -> list[int]:
        state = self.states.get(req.request_id)
        m = req.num_computed_tokens
        if state is None or not state.cut(m) or state.end < m or state.num_rows == 0:
            return []  # no hidden states for the request's last computed token
        normed, prenorm = self._feed(state, req.all_token_ids, m)
        token = self.head.draft_ids(normed)
        drafts = [int(token)]
        k_tmp, v_tmp = [], []
        for j in range(1, k):
            q, kj, vj, residual = self.head.qkv_of(token, prenorm,
                                                   torch.tensor([m - 1 + j]))
            k_tmp.append(kj)
            v_tmp.append(vj)
            keys = torch.cat([state.k[: state.n], *k_tmp])
            values = torch.cat([state.v[: state.n], *v_tmp])
            normed, prenorm = self.head.after_attention(self._attend(q, keys, values, None),
                                                        residual)
            token = self.head.draft_ids(normed)
            drafts.append(int(token))
        return drafts

    def _feed(self, state: _HeadState, tokens: list[int], upto: int):
        """Run the head over the pending rows of positions [rows_start, upto), keeping their
        K/V; returns the last row's (normed, pre-norm) outputs, [1, H] each."""
        first = state.rows_start
        num = upto - first
        rows = torch.cat(state.rows)
        pending, rest = rows[:num], rows[num:]
        ids = torch.tensor(tokens[first + 1 : upto + 1])  # the token after each position
        positions = torch.arange(first, upto)
        q, k, v, residual = self.head.qkv_of(ids, self.head.combine(pending), positions)
        prior = state.n
        state.append_kv(k, v)
        state.rows, state.num_rows = [rest], rest.shape[0]
        # query i (position first + i) sees the head's keys up to its own position
        mask = (torch.arange(state.n)[None, :] <= (prior + torch.arange(num))[:, None])
        normed, prenorm = self.head.after_attention(
            self._attend(q, state.k[: state.n], state.v[: state.n], mask), residual)
        return normed[-1:], prenorm[-1:]

    def _attend(self, q, keys, values, mask) -> torch.Tensor:
        """q [T, heads, D], keys/values [S, kv_heads, D] -> [T, heads * D]."""
        s = self.head.spec
        group = s.num_heads // s.num_kv_heads
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, S, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), keys, values, attn_mask=mask)  # [heads, T, D]
        return out.transpose(0, 1).reshape(q.shape[0], -1)

    # ---- lifetime ----------------------------------------------------------------------------
    def drop(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def finished(self, req: Request) -> None:
        self.drop(req.request_id)

    def close(self) -> None:
        self.states.clear()
        self.runner.capture_aux_hidden(())
