"""What both ends of the step protocol remember per request, so a step sends only what changed.

The driver names every scheduled request by a slot (a small int it hands out while the request
runs). The executor (the in-process ModelRunner, or every rank of a T x P set) keeps each slot's
block table and, for a request a penalty reads, its token history; a StepCommand carries only
the blocks and output tokens appended since the slot last ran:

    driver (StepBuilder + SentSlots)                  executor (StepReceiver)
    slot s: sent [7, 3, 9]                            slot s: [7, 3, 9]
    step: num_known_blocks=3, new_block_ids=[12]  ->  3 == len(table) ? extend : StepProtocolError
    after:  sent [7, 3, 9, 12]                        slot s: [7, 3, 9, 12]

Invariant: after every command the executor has applied, each slot's table equals the driver's
mirror of it, and the mirror is a prefix of the request's `block_ids`. `num_known_blocks = 0`
(a new request, one resumed after preemption, a table that changed other than by appending)
sends the whole table and resets the slot, history included. Slots of requests that left the
running state (finished, aborted, preempted) are announced in `freed_slots` and dropped first.

An executor applies a command before anything else can fail; where it may not have (its
`execute` raised), the engine calls `StepBuilder.step_failed` and the next command resends those
requests whole, which is right whether or not the executor applied the failed one. A mismatch the
executor sees (a table length, or `table_checksum` over the tables it rebuilt) raises
StepProtocolError: a divergence is an error, never attention over wrong blocks.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import msgspec

from hearth.engine.kv.cache import cdiv
from hearth.engine.request import Request, RequestStatus


class StepProtocolError(RuntimeError):
    """The executor's slot state does not match what the driver's command assumes."""


def table_checksum_term(i: int, table: list[int]) -> int:
    """Request i's part of `table_checksum`."""
    return (i + 1) * (31 * sum(table) + (table[-1] if table else -1))


def table_checksum(tables: list[list[int]]) -> int:
    """A cheap check that the executor's rebuilt tables are the driver's (the requests' order,
    each table's sum and last block; lengths are checked on their own)."""
    return sum(table_checksum_term(i, t) for i, t in enumerate(tables))


@dataclass
class _Sent:
    """The driver's mirror of one slot on the executor."""

    req: Request
    slot: int
    block_ids: list[int]  # the slot's table as the executor holds it
    num_output: int | None = None  # output tokens of the history the executor holds; None: none


class StepPlan:
    """One command's changes to the driver's slots, applied by `commit` once the whole command is
    built (a build that raises part way, e.g. in a grammar mask, changes nothing)."""

    def __init__(self, sent: SentSlots, scheduled: list[tuple[Request, int]]) -> None:
        self.sent = sent
        running = RequestStatus.RUNNING
        gone = {rid for rid, e in sent.entries.items() if e.req.status is not running}
        gone.update(req.request_id for req, _ in scheduled  # an id reused by a new request
                    if req.request_id in sent.entries
                    and sent.entries[req.request_id].req is not req)
        self.gone = sorted(gone)
        free = sent.free_slots + [sent.entries[rid].slot for rid in gone]
        heapq.heapify(free)
        self.freed = sorted(set(sent.unannounced + [sent.entries[rid].slot for rid in gone]))
        self.entries: list[_Sent] = []  # per scheduled request: its mirror after this command
        self.fresh: list[bool] = []  # whether its entry is new (or reset) in this command
        self.extensions: list[tuple[list[int], int | None]] = []  # (blocks, num_output) to add
        num_slots = sent.num_slots
        for req, _ in scheduled:
            entry = sent.entries.get(req.request_id)
            if entry is None or req.request_id in gone:
                if free:
                    slot = heapq.heappop(free)
                else:
                    slot, num_slots = num_slots, num_slots + 1
                entry = _Sent(req, slot, [])
            self.entries.append(entry)
            self.fresh.append(not entry.block_ids)
            self.extensions.append(([], entry.num_output))
        self.free_slots, self.num_slots = free, num_slots

    @property
    def slots(self) -> list[int]:
        return [e.slot for e in self.entries]

    def blocks(self, i: int, num_blocks: int) -> tuple[int, list[int]]:
        """(num_known_blocks, new_block_ids) for scheduled request i, whose step reads the first
        `num_blocks` blocks of its table."""
        entry = self.entries[i]
        req_blocks, known = entry.req.block_ids, len(entry.block_ids)
        if self.fresh[i] or req_blocks[:known] != entry.block_ids:  # freed and re-allocated
            self._reset(i)
            new = req_blocks[:num_blocks]
            self.extensions[i] = (new, None)
            return 0, new
        new = req_blocks[known:num_blocks]
        self.extensions[i] = (new, self.extensions[i][1])
        return known, new

    def history(self, i: int) -> tuple[list[int], list[int], int]:
        """(prompt_ids, output_ids, output_start) of request i's sample row when a penalty reads
        its history: the output tokens after the `output_start` the executor holds, or the whole
        history (output_start 0) when it holds none or no output token yet. A request's output
        only grows while it runs (the draft model's shadows, which are rewritten, are never
        penalised); a shorter one is resent whole."""
        req = self.entries[i].req
        sent = self.extensions[i][1]
        new_blocks = self.extensions[i][0]
        outputs = req.output_token_ids
        if not sent or sent > len(outputs):
            self.extensions[i] = (new_blocks, len(outputs))
            return req.prompt_token_ids, outputs, 0
        self.extensions[i] = (new_blocks, len(outputs))
        return [], outputs[sent:], sent

    def _reset(self, i: int) -> None:
        if not self.fresh[i]:
            old = self.entries[i]
            self.entries[i] = _Sent(old.req, old.slot, [])
            self.fresh[i] = True

    def commit(self) -> None:
        sent = self.sent
        for rid in self.gone:
            del sent.entries[rid]
        for entry, (new, num_output) in zip(self.entries, self.extensions):
            entry.block_ids.extend(new)
            entry.num_output = num_output
            sent.entries[entry.req.request_id] = entry
        sent.free_slots, sent.num_slots = self.free_slots, self.num_slots
        sent.unannounced = []
        sent.last = ([e.req.request_id for e in self.entries], self.freed)


class SentSlots:
    """The driver's side: which slot each running request has, and what the executor holds."""

    def __init__(self) -> None:
        self.entries: dict[str, _Sent] = {}  # request_id -> mirror
        self.free_slots: list[int] = []  # a heap: the lowest free slot is handed out first
        self.num_slots = 0  # slots ever handed out (the executor's slot ids are below this)
        self.unannounced: list[int] = []  # freed slots the next command must announce
        self.last: tuple[list[str], list[int]] = ([], [])  # (request ids, freed) of the last

    def plan(self, scheduled: list[tuple[Request, int]]) -> StepPlan:
        return StepPlan(self, scheduled)

    def forget_last(self) -> None:
        """The last command may not have been applied: its requests get fresh slots (sent whole)
        and its slots are announced freed again (dropping an unknown slot is a no-op)."""
        request_ids, freed = self.last
        drop = set(freed)
        for rid in request_ids:
            entry = self.entries.pop(rid, None)
            if entry is not None:
                heapq.heappush(self.free_slots, entry.slot)
                drop.add(entry.slot)
        self.unannounced = sorted(drop | set(self.unannounced))
        self.last = ([], [])


@dataclass
class _Slot:
    """The executor's state of one slot."""

    block_ids: list[int]
    prompt_ids: list[int] | None = None  # the history a penalty reads, once a row sent it
    output_ids: list[int] | None = None


@dataclass
class ReceivedStep:
    """A command's tables and sample rows made whole again: what the step computes from."""

    block_tables: list[list[int]]  # request i: its first cdiv(context_lens[i], block_size)
    samples: list  # SampleRows with prompt_ids/output_ids whole where a penalty reads them


class StepReceiver:
    """The executor's side: applies each command's slot changes in order (every rank applies
    every command, whole, before running any micro-batch of it)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, _Slot] = {}

    def receive(self, cmd) -> ReceivedStep:
        for slot in cmd.freed_slots:
            self.slots.pop(slot, None)
        tables = []
        for i, slot in enumerate(cmd.slots):
            known, new = cmd.num_known_blocks[i], cmd.new_block_ids[i]
            if known == 0:
                state = self.slots[slot] = _Slot(list(new))
            else:
                state = self.slots.get(slot)
                have = -1 if state is None else len(state.block_ids)
                if have != known:
                    raise StepProtocolError(f"slot {slot}: the driver assumes {known} blocks "
                                            f"held, this executor has {max(have, 0)}")
                state.block_ids.extend(new)
            num_blocks = cdiv(cmd.context_lens[i], self.block_size)
            if len(state.block_ids) < num_blocks:
                raise StepProtocolError(f"slot {slot}: {len(state.block_ids)} blocks for a "
                                        f"context of {cmd.context_lens[i]} tokens")
            tables.append(state.block_ids[:num_blocks])
        if table_checksum(tables) != cmd.table_checksum:
            raise StepProtocolError("block tables differ from the driver's (checksum)")
        return ReceivedStep(tables, [self._whole(row, cmd.slots[row.index])
                                     for row in cmd.samples])

    def _whole(self, row, slot: int):
        if not row.penalised:
            return row
        state = self.slots[slot]
        if row.output_start == 0:
            state.prompt_ids, state.output_ids = row.prompt_ids, list(row.output_ids)
        elif state.output_ids is None or len(state.output_ids) != row.output_start:
            have = None if state.output_ids is None else len(state.output_ids)
            raise StepProtocolError(f"slot {slot}: the driver assumes {row.output_start} output "
                                    f"tokens held, this executor has {have}")
        else:
            state.output_ids.extend(row.output_ids)
        return msgspec.structs.replace(row, prompt_ids=state.prompt_ids,
                                       output_ids=state.output_ids, output_start=0)
