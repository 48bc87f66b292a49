"""The suffix proposer's tries: counted suffix tries over the rows in flight and the cached responses, kept in step
with the generator's slots; `SuffixProposer` (`specdec/proposers/suffix.py`) drafts from them.

Two kinds of counted suffix tries (`specdec/suffix_index.py`) share one node store:

- one trie per distinct prompt: the prompt itself (prompt lookup) and every response to it, the row's own output and
  its siblings in flight included, and the responses of earlier calls that are still cached;
- one global trie: every response, in flight or cached, of every prompt.

Each response enters both tries behind a separator token (outside the vocabulary), so "the start of a response" is a
context like any other. Rows are inserted token by token as they grow; a finished row's response stays in both tries
as history, oldest evicted first past `max_cached_requests` (0 keeps none past the row's own life). Each row keeps a
frontier: its trie nodes for its last 0..depth-1 tokens, the match lengths drafting starts from.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import pathlib
import weakref
import zipfile
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from rollout_kernels.device_io import host
from specdec.proposers.base import Proposer
from specdec.suffix_index import SuffixIndex

_TAKING_IN: ThreadPoolExecutor | None = None  # the one thread every background insertion runs on, made by the first


def _taking_in_thread() -> ThreadPoolExecutor:
    """The process's one thread for background insertions (shared: a trainer that builds and keeps many generators
    holds one idle thread, not one per proposer; insertions of two proposers run one after the other)."""
    global _TAKING_IN
    if _TAKING_IN is None:
        _TAKING_IN = ThreadPoolExecutor(max_workers=1, thread_name_prefix="suffix-take-in")
    return _TAKING_IN


_HANDED_OVER: weakref.WeakSet = weakref.WeakSet()  # histories that handed an insertion to that thread


def _finish_insertions_before_fork() -> None:
    """Wait for every insertion in progress: a child forked meanwhile would copy half-updated tries, and a future
    that no thread of its own ever completes (its `wait` blocked for good)."""
    for tries in list(_HANDED_OVER):
        taking_in = tries._taking_in
        if taking_in is not None:
            concurrent.futures.wait([taking_in])  # (its error, if any, is raised by the next `wait`, in either)


def _forget_thread_in_child() -> None:
    global _TAKING_IN
    _TAKING_IN = None  # a forked child has none of its parent's threads: work handed to that one would never run


os.register_at_fork(before=_finish_insertions_before_fork, after_in_child=_forget_thread_in_child)


@dataclass
class _PromptTrie:
    root: int
    prompt: np.ndarray  # [P] int32
    num_rows: int = 0  # rows of this prompt in flight
    num_responses: int = 0  # its cached responses


class SuffixTries(Proposer):
    """The tries and per-slot state of the suffix proposer, and the history a user keeps, inspects, saves and loads
    (`Generator.draft_history`). The generator's hooks keep them in step with its slots; drafting is `SuffixProposer`'s.

    Args:
        vocab_size: the target's vocabulary size (its value is the separator token).
        num_slots: the generator's slots (rows).
        num_positions: tokens a row may hold (prompt + completion).
        max_tree_depth: longest n-gram counted (`suffix_decoding_max_tree_depth`).
        max_cached_requests: finished responses kept as history (`suffix_decoding_max_cached_requests`); 0 = none.
        background: take in a step's tokens without drafts (`update`) on a thread of its own, while the caller goes
            on (the compiled insertion releases the GIL); every other call waits for it first, so the tries, and the
            drafts, are those of taking the tokens in at once. For a host that is the bottleneck of a step (a GPU's
            plain steps run ahead) and has a core to spare. The caller must not change the rows' tokens it handed
            over, at positions below their counts, before the next call (`wait`).
    """

    needs_prefill = True
    index_class = SuffixIndex  # the node store (the numpy reference's in `specdec/proposers/suffix_ref.py`)

    def __init__(
        self,
        vocab_size: int,
        num_slots: int,
        num_positions: int,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        background: bool = False,
    ):
        if not isinstance(max_tree_depth, int) or max_tree_depth < 2:  # a match and a draft token at least
            raise ValueError(
                f"suffix_decoding_max_tree_depth ({max_tree_depth!r}) must be an integer >= 2 (vLLM's default: 24)"
            )
        if vocab_size >= 1 << 21:  # the trie keys hold a token (or the separator, vocab_size) in 21 bits
            raise ValueError(f"method 'suffix' handles vocabularies of up to {(1 << 21) - 1} tokens, got {vocab_size}")
        self.separator = vocab_size
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self._num_slots, self._num_positions = num_slots, num_positions
        from specdec.proposers import suffix_sync_kernels  # numba: imported with the first suffix proposer

        self._sync_kernels = suffix_sync_kernels
        self.background = background
        self._taking_in: Future | None = None  # the background insertion in progress (`_taking_in_thread`)
        # what a user's call on the history holds: its generator sets one that refuses a call from another thread
        # while a call of the generator runs (its insertion would run beside the step's: a crash)
        self.guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self._start_empty()

    # ---- history: what a user keeps, inspects, saves and loads ---------------------------------------------------

    def wait(self) -> None:
        """Finish taking in the tokens a background `update` handed over (its error, if any, is raised here). A signal
        that interrupts the wait leaves the insertion to be waited for by the next call."""
        taking_in = self._taking_in
        if taking_in is None:
            return
        try:
            taking_in.result()
        finally:
            if taking_in.done():
                self._taking_in = None

    def clear(self) -> None:
        """Forget every cached response. Rows in flight (a call under way, as when an `on_step` callback clears, or a
        server's requests) stay in the tries, and join the history as they finish."""
        with self.guard():
            self.wait()
            if not self._in_flight.any():
                self._start_empty()
                return
            self._evict(keep=0)  # every cached response, and the tries only they held

    def _start_empty(self) -> None:
        """Forget every response and every row in flight."""
        self.wait()
        depth, slots = self.max_tree_depth, self._num_slots
        self.index = self.index_class(depth)
        self.global_root = self.index.new_root()
        self.prompts: dict[bytes, _PromptTrie] = {}
        self.history: collections.deque[tuple[bytes, np.ndarray]] = collections.deque()  # oldest first
        self._frontiers = np.full((2, slots, depth), -1, dtype=np.int32)  # [prompt trie | global trie, slot, m]
        self._num_inserted = np.zeros(slots, dtype=np.int64)  # tokens of the row (prompt included) in the tries
        self._prompt_len = np.zeros(slots, dtype=np.int64)
        self._in_flight = np.zeros(slots, dtype=bool)
        self._rewound_at = np.full(slots, -1, dtype=np.int64)  # a pending token a restore may have changed (`rewind`)
        self._slot_prompt: list[bytes | None] = [None] * slots
        self._responses = np.zeros((slots, self._num_positions), dtype=np.int32)
        self._dead_tokens = 0  # tokens removed since the store was built: a rebuild frees their nodes
        # sequences waiting for the next insertion, finished rows' last tokens (prompt-trie then global-trie frontiers
        # [S, D], tokens [S, L], lengths [S]); [number of them in use, a row was rewound], kept by the kernel
        self._pending = (np.zeros((0, depth), np.int32), np.zeros((0, 1), np.int64), np.zeros(0, np.int64))
        self._pending_status = np.zeros(2, dtype=np.int64)
        self._all_rows = np.arange(slots, dtype=np.int64)
        self._deferred_responses = 0  # the newest cached responses (none added after) whose last tokens are deferred

    def stats(self) -> dict:
        """The cached history's size: responses, their tokens, distinct prompts, trie nodes and bytes held (the nodes
        of evicted responses too, until the store is rebuilt)."""
        with self.guard():
            self.flush()
            return {
                "responses": len(self.history),
                "tokens": int(sum(len(r) for _, r in self.history)),
                "prompts": len(self.prompts),
                "nodes": self.index.num_nodes,
                "bytes": self.index.nbytes + int(sum(r.nbytes for _, r in self.history)),
            }

    def add_responses(self, prompts: list[list[int]], responses: list[list[int]]) -> None:
        """Add responses made elsewhere (an earlier run, another model) to the history, oldest first:
        `responses[i]` answers `prompts[i]` (token ids). Past `max_cached_requests` the oldest are evicted."""
        with self.guard():
            self.wait()
            if not isinstance(prompts, (list, tuple)) or not isinstance(responses, (list, tuple)):
                raise ValueError("prompts and responses must be lists of token-id lists")
            if len(prompts) != len(responses):
                raise ValueError(
                    f"got {len(prompts)} prompts but {len(responses)} responses: give one prompt per response"
                )
            for name, sequences in (("prompts", prompts), ("responses", responses)):
                for i, seq in enumerate(sequences):
                    try:
                        ids = np.asarray(seq)
                    except ValueError:  # a ragged nest of lists
                        ids = None
                    if ids is None or not self._in_vocabulary(ids):
                        raise ValueError(f"{name}[{i}] must be a list of token ids in [0, {self.separator})")
            self.flush()  # the responses whose last tokens are deferred stay the newest ones (what `_evict` relies on)
            self._add_history(
                [
                    (np.asarray(p, dtype=np.int32).tobytes(), np.asarray(r, dtype=np.int32))
                    for p, r in zip(prompts, responses)
                ]
            )
            self._evict()

    def adopt(self, other: SuffixTries) -> None:
        """Take the history of `other` (another generator's `draft_history`: its tries and cached responses, as they
        are) in place of this one's, without the rebuild that `save` and `load` make (seconds for a large history);
        `other` is left empty. For a generator built again over the same model, e.g. after one closed to free its
        device memory. Both must count n-grams of the same depth over the same vocabulary, and neither may have rows
        in flight. Past this one's `max_cached_requests`, the oldest responses are evicted."""
        if other is self:
            return  # (it would be emptied)
        if not isinstance(other, SuffixTries) or type(other.index) is not type(self.index):
            raise ValueError(f"adopt takes another suffix proposer's history, got {type(other).__name__}")
        if (other.separator, other.max_tree_depth) != (self.separator, self.max_tree_depth):
            raise ValueError(
                f"adopt: that history counts n-grams up to {other.max_tree_depth} tokens over a vocabulary of "
                f"{other.separator}, this one up to {self.max_tree_depth} over {self.separator}: load a saved one"
            )
        with self.guard(), other.guard():
            other.flush()  # (its background insertion waited for, its finished rows' last tokens inserted)
            self.flush()
            if other._in_flight.any() or self._in_flight.any():
                raise ValueError("adopt: a history with rows in flight cannot move: call it between generate calls")
            self.index, self.global_root, self.prompts = other.index, other.global_root, other.prompts
            self.history, self._dead_tokens = other.history, other._dead_tokens
            other._start_empty()
            self._evict()

    def _in_vocabulary(self, ids: np.ndarray) -> bool:
        """Whether `ids` is one sequence of token ids of the target's vocabulary (empty is)."""
        if ids.ndim != 1:
            return False
        return not ids.size or (ids.dtype.kind in "iu" and ids.min() >= 0 and ids.max() < self.separator)

    def save(self, path: str | pathlib.Path) -> None:
        """Write the cached responses (oldest first, each with its prompt) to `path` (that name as given: numpy would
        add `.npz` to one without it, and `load(path)` then found nothing), an `.npz` archive; or to a binary file
        object."""
        with self.guard():
            self.wait()
            keys = [k for k, _ in self.history]
            number = {key: i for i, key in enumerate(dict.fromkeys(keys))}  # each distinct prompt once
            prompts = [np.frombuffer(k, dtype=np.int32) for k in number]
            responses = [r for _, r in self.history]
            arrays = dict(
                prompt_tokens=np.concatenate(prompts or [np.zeros(0, np.int32)]),
                prompt_lens=np.array([len(p) for p in prompts], dtype=np.int64),
                response_tokens=np.concatenate(responses or [np.zeros(0, np.int32)]),
                response_lens=np.array([len(r) for r in responses], dtype=np.int64),
                response_prompt=np.array([number[k] for k in keys], dtype=np.int64),
            )
            if isinstance(path, (str, os.PathLike)):
                with open(path, "wb") as file:
                    np.savez_compressed(file, **arrays)
            else:
                np.savez_compressed(path, **arrays)

    def load(self, path: str | pathlib.Path) -> None:
        """Replace the history by the responses saved in `path`, the newest `max_cached_requests` of them (rows in
        flight stay, and join it as they finish). A file that cannot be read as one `save` writes is refused with a
        ValueError, the history left as it was."""
        with self.guard():
            self.wait()
            where = f"cannot load a suffix history from {str(path)!r}"
            try:
                data = np.load(path)
                if not isinstance(data, np.lib.npyio.NpzFile):
                    raise ValueError(f"expected an .npz archive, found one {type(data).__name__}")
                with data:
                    arrays = {name: data[name] for name in _SAVED}
            except _UNREADABLE as error:
                raise ValueError(f"{where}: {type(error).__name__}: {error}") from error
            # a history made for a larger vocabulary, or a damaged file
            for name in ("prompt_tokens", "response_tokens"):
                if not self._in_vocabulary(arrays[name]):
                    raise ValueError(
                        f"{where}: its {name} hold ids outside this model's vocabulary [0, {self.separator}); load a "
                        "history saved for this model"
                    )
            problem = _inconsistent(arrays)
            if problem:
                raise ValueError(f"{where}: {problem}; the file is damaged or was not written by save()")
            prompts = np.split(arrays["prompt_tokens"].astype(np.int32), np.cumsum(arrays["prompt_lens"])[:-1])
            responses = np.split(arrays["response_tokens"].astype(np.int32), np.cumsum(arrays["response_lens"])[:-1])
            owners = arrays["response_prompt"].tolist()
            self.clear()
            # only what the history keeps goes in: the older ones, inserted and evicted at once, left their nodes in the
            # store (all of them with max_cached_requests=0) until a later call rebuilt it
            kept = range(max(len(owners) - max(self.max_cached_requests, 0), 0), len(owners))
            if kept:
                # the responses whose last tokens are deferred stay the newest ones (what `_evict` relies on)
                self.flush()
                self._add_history([(prompts[owners[i]].tobytes(), responses[i]) for i in kept])
                self._evict()

    # ---- the generator's hooks ---------------------------------------------------------------------------------

    def reset(self) -> None:
        self._start_empty()

    def begin(self) -> None:
        """A call starts: rows left in flight by an interrupted call (or the warm-up) are removed; a store that
        holds more dead tokens than live ones is rebuilt."""
        self.flush()
        stale = self._in_flight.nonzero()[0]
        if stale.size:
            self._remove_rows(stale)
        live = sum(len(r) for _, r in self.history) + sum(len(e.prompt) for e in self.prompts.values())
        if self._dead_tokens > max(live, 1 << 16):
            history = list(self.history)
            self._start_empty()
            self._add_history(history)

    def prefill(self, row_start: int, prompts: list[list[int]], group_of: Tensor, states: list[dict]) -> None:
        self.wait()
        rows = np.arange(row_start, row_start + len(states))
        groups = host(group_of).numpy()
        entries = self._prompt_tries([np.asarray(p, dtype=np.int32) for p in prompts])
        for row, group in zip(rows.tolist(), groups.tolist()):
            entries[group].num_rows += 1
            self._slot_prompt[row] = entries[group].prompt.tobytes()
            self._prompt_len[row] = self._num_inserted[row] = len(prompts[group])
        roots = np.array([e.root for e in entries])[groups]
        self._frontiers[:, rows] = self._start_responses(roots)
        self._in_flight[rows] = True
        self._rewound_at[rows] = -1

    def copy_rows(self, src: Tensor, dst: Tensor, num_positions: int) -> None:
        self.wait()
        src, dst = host(src).numpy(), host(dst).numpy()  # the engine's row indices, on the host
        self._frontiers[:, dst] = self._frontiers[:, src]
        for array in (self._num_inserted, self._prompt_len, self._in_flight, self._rewound_at):
            array[dst] = array[src]
        self._responses[dst, :num_positions] = self._responses[src, :num_positions]
        src_rows, dst_rows = src.tolist(), dst.tolist()  # a few rows a step: Python sets beat numpy's set routines
        for s, d in zip(src_rows, dst_rows):
            self._slot_prompt[d] = self._slot_prompt[s]
        moved_away = set(src_rows).difference(dst_rows)  # the rows live at dst now
        if moved_away:
            self._in_flight[list(moved_away)] = False

    def finish(self, rows: list[int], token_ids: Tensor, num_tokens: list[int]) -> None:
        """Rows finished: keep their responses as history. Their last tokens go into the tries with the next step's
        (one insertion per step instead of two; before anything drafts, counts or evicts)."""
        self.wait()
        rows_np = np.asarray(rows, dtype=np.int64)
        self._sync(rows_np, token_ids.numpy(), np.asarray(num_tokens, dtype=np.int64), defer=True)
        finished = []
        for row in rows:
            key = self._slot_prompt[row]
            entry = self.prompts[key]
            entry.num_rows -= 1
            entry.num_responses += 1
            finished.append((key, self._responses[row, : self._num_inserted[row] - self._prompt_len[row]].copy()))
        self._in_flight[rows_np] = False
        self.history.extend(finished)
        self._deferred_responses += len(finished)
        self._evict()

    def drop(self, rows: list[int]) -> None:
        """Rows left flight unfinished: their text so far leaves the tries (kept as history only when finished)."""
        self.wait()
        slots = np.asarray(rows, dtype=np.int64)
        slots = slots[self._in_flight[slots]]
        if slots.size:
            self._remove_rows(slots)

    def rewind(self, rows: list[int], num_tokens: list[int]) -> None:
        """Rows restored to hold `num_tokens[i]` tokens: where the tries took in their pending token (the last), the
        next insertion checks it against the row's and, if a restore changed it, the row starts over. (Rows rolled
        back below what the tries hold start over anyway.)"""
        self.wait()
        slots, lengths = np.asarray(rows, dtype=np.int64), np.asarray(num_tokens, dtype=np.int64)
        reached = self._in_flight[slots] & (lengths > self._prompt_len[slots]) & (lengths <= self._num_inserted[slots])
        self._rewound_at[slots[reached]] = lengths[reached] - 1

    def update(self, token_ids: Tensor, num_tokens: list[int]) -> None:
        self.wait()
        args = (self._all_rows[: len(num_tokens)], token_ids.numpy(), np.asarray(num_tokens, dtype=np.int64))
        if not self.background:
            self._sync(*args)
            return
        self._taking_in = _taking_in_thread().submit(self._sync, *args)
        _HANDED_OVER.add(self)

    # ---- keeping the tries in step with the rows -------------------------------------------------------------------

    def _start_responses(self, roots: np.ndarray) -> np.ndarray:
        """`[2, N, D]` frontiers of N new responses (prompt trie, global trie), the separator inserted."""
        starts = np.concatenate([roots, np.full(len(roots), self.global_root)])
        separators = np.full(2 * len(roots), self.separator)
        return self.index.extend(self.index.start(starts), separators).reshape(2, len(roots), -1)

    def _sync(self, rows: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray, defer: bool = False) -> None:
        """Insert the tokens each of `rows` gained since the last call (`token_ids[rows[i], :num_tokens[i]]`), with the
        deferred ones, in one compiled call. `defer` (finishing rows): keep them for the next insertion instead."""
        self._restart_changed(rows, token_ids)
        index = self.index
        for _ in range(2):
            size = (int(self._pending_status[0]) + 2 * len(rows)) * self.max_tree_depth
            args = (self._frontiers, self._num_inserted, self._prompt_len, self._responses, rows, token_ids, num_tokens)
            self._pending = index.run(
                self._sync_kernels.sync_rows, *index.scratch(size), *args, *self._pending, self._pending_status, defer
            )
            if not self._pending_status[1]:
                if not defer:  # the finished rows' deferred tokens went in with these
                    self._deferred_responses = 0
                return
            self._restart_rows(rows[num_tokens < self._num_inserted[rows]])  # then take in their tokens
        raise AssertionError("expected no rewound row after restarting them")

    def _restart_changed(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Rows `rewind` marked whose token at the marked position is not the one the tries took in there (`token_ids`
        as `_sync` takes it) start over."""
        marked = rows[self._rewound_at[rows] >= 0]
        if not marked.size:
            return
        at = self._rewound_at[marked]
        self._rewound_at[marked] = -1
        taken_in = self._responses[marked, at - self._prompt_len[marked]]
        changed = marked[token_ids[marked, at] != taken_in]
        if changed.size:
            self._restart_rows(changed)

    def _restart_rows(self, slots: np.ndarray) -> None:
        """Rows rolled back (`Generator.restore`, the warm-up's probes) start their responses over: what they had taken
        in leaves the tries (it is text no row holds any more), and each starts again behind a separator."""
        keys = self._take_out(slots)
        self._frontiers[:, slots] = self._start_responses(np.array([self.prompts[key].root for key in keys]))
        self._num_inserted[slots] = self._prompt_len[slots]
        self._rewound_at[slots] = -1

    def flush(self) -> None:
        """Insert the finished rows' last tokens now (`finish` defers them to the next step's insertion): the tries
        then hold exactly the cached responses and the rows in flight."""
        self.wait()
        if self._pending_status[0]:
            self._sync(self._all_rows[:0], np.zeros((0, 0), np.int64), np.zeros(0, np.int64))
        self._deferred_responses = 0

    def _prompt_tries(self, prompts: list[np.ndarray]) -> list[_PromptTrie]:
        """The trie of each prompt (`[P]` int32 arrays), created for those not seen before: all new prompts go into
        their tries in one insertion."""
        keys = [p.tobytes() for p in prompts]
        new = {key: prompt for key, prompt in zip(keys, prompts) if key not in self.prompts}
        if new:
            entries = [_PromptTrie(self.index.new_root(), prompt) for prompt in new.values()]
            self.index.add_sequences(np.array([e.root for e in entries]), *_padded([e.prompt for e in entries]))
            self.prompts.update(zip(new, entries))
        return [self.prompts[key] for key in keys]

    def _add_history(self, responses: list[tuple[bytes, np.ndarray]]) -> None:
        """Insert finished responses (oldest first) into their prompt tries and the global trie."""
        if not responses:
            return
        entries = self._prompt_tries([np.frombuffer(k, dtype=np.int32) for k, _ in responses])
        for entry in entries:
            entry.num_responses += 1
        self._apply([e.root for e in entries], [r for _, r in responses], +1)
        self.history.extend(responses)

    def _evict(self, keep: int | None = None) -> None:
        """Drop the oldest responses past `keep` (None: `max_cached_requests`), and prompt tries nothing refers to any
        more."""
        excess = len(self.history) - (self.max_cached_requests if keep is None else keep)
        if excess <= 0:
            return
        if excess > len(self.history) - self._deferred_responses:  # removing a response needs all of it inserted
            self.flush()
        evicted = [self.history.popleft() for _ in range(excess)]
        entries = [self.prompts[k] for k, _ in evicted]
        self._apply([e.root for e in entries], [r for _, r in evicted], -1)
        for (key, response), entry in zip(evicted, entries):
            entry.num_responses -= 1
            self._dead_tokens += len(response)
            self._drop_if_unused(key)

    def _remove_rows(self, slots: np.ndarray) -> None:
        """Take rows in flight out of the tries (their response so far) without keeping them as history."""
        keys = self._take_out(slots)
        self._in_flight[slots] = False
        for key in keys:
            self.prompts[key].num_rows -= 1
            self._drop_if_unused(key)

    def _take_out(self, slots: np.ndarray) -> list[bytes]:
        """The responses the rows have taken in so far leave the tries (their tokens are dead); returns the rows'
        prompt keys."""
        keys = [self._slot_prompt[s] for s in slots.tolist()]
        responses = [self._responses[s, : self._num_inserted[s] - self._prompt_len[s]] for s in slots.tolist()]
        self._apply([self.prompts[key].root for key in keys], responses, -1)
        self._dead_tokens += sum(len(r) for r in responses)
        return keys

    def _drop_if_unused(self, key: bytes) -> None:
        entry = self.prompts.get(key)
        if entry is not None and entry.num_rows == 0 and entry.num_responses == 0:
            self._dead_tokens += len(entry.prompt)  # its trie is unreachable now
            del self.prompts[key]

    def _apply(self, roots: list[int], responses: list[np.ndarray], delta: int) -> None:
        """Insert (+1) or remove (-1) whole responses, separator first, in their prompt tries and the global trie: in
        runs of consecutive responses whose padding to their longest stays within `_PADDED_CELLS` (one long response
        among many short ones padded them all to its length: 7 GB and 13 s for 5000 responses and one of 4000 tokens,
        against 2 GB and 3 s without it)."""
        start = 0
        for stop in _runs_within([len(r) + 1 for r in responses], _PADDED_CELLS):
            tokens, lengths = _padded([np.concatenate(([self.separator], r)) for r in responses[start:stop]])
            starts = np.concatenate([np.asarray(roots[start:stop]), np.full(stop - start, self.global_root)])
            self.index.add_sequences(
                starts, np.concatenate([tokens, tokens]), np.concatenate([lengths, lengths]), delta
            )
            start = stop


# what reading a file that is not an .npz `save` wrote raises (a truncated or altered archive, a pickle, another file)
_UNREADABLE = (
    OSError, EOFError, KeyError, ValueError, TypeError, IndexError, zipfile.BadZipFile, zlib.error,
    NotImplementedError, RuntimeError, MemoryError,  # an unknown compression, an encrypted member, a huge shape
)  # fmt: skip
_SAVED = ("prompt_tokens", "prompt_lens", "response_tokens", "response_lens", "response_prompt")  # `save`'s arrays


def _inconsistent(arrays: dict[str, np.ndarray]) -> str | None:
    """What makes `save`'s arrays (token ids already checked) not one history, or None."""
    for name in _SAVED[1:]:
        if name.endswith("_tokens"):
            continue
        if arrays[name].ndim != 1 or (arrays[name].size and arrays[name].dtype.kind not in "iu"):
            return f"{name} must be one row of integers, got shape {arrays[name].shape} of {arrays[name].dtype}"
        if arrays[name].size and arrays[name].min() < 0:
            return f"{name} holds a negative value"
    for kind in ("prompt", "response"):
        lens, size = arrays[f"{kind}_lens"], arrays[f"{kind}_tokens"].size
        if lens.size and lens.max() > size:  # (a sum of huge lengths can wrap around to the right total)
            return f"{kind}_lens holds a length of {lens.max()} tokens, {kind}_tokens holds {size} in all"
        total = int(lens.sum())
        if total != size:
            return f"{kind}_lens add up to {total} tokens, {kind}_tokens holds {size}"
    num_responses, num_prompts = len(arrays["response_lens"]), len(arrays["prompt_lens"])
    if len(arrays["response_prompt"]) != num_responses:
        return f"response_prompt names {len(arrays['response_prompt'])} prompts for {num_responses} responses"
    if num_responses and arrays["response_prompt"].max() >= num_prompts:
        return f"response_prompt names prompt {arrays['response_prompt'].max()} of {num_prompts}"
    return None


_PADDED_CELLS = 1 << 21  # padded tokens of one insertion of whole sequences at most (one sequence may pass it)


def _runs_within(lengths: list[int], cells: int) -> list[int]:
    """The ends of consecutive runs of `lengths` whose count times their longest stays within `cells` (a run holds
    one sequence at least)."""
    ends, count, longest = [], 0, 0
    for i, length in enumerate(lengths):
        if count and (count + 1) * max(longest, length) > cells:
            ends.append(i)
            count, longest = 0, 0
        count, longest = count + 1, max(longest, length)
    if count:
        ends.append(len(lengths))
    return ends


def _padded(sequences: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Token sequences as rows `[N, longest]` int64 (0 past each one's end) and their lengths `[N]`."""
    lengths = np.array([len(q) for q in sequences], dtype=np.int64)
    tokens = np.zeros((len(sequences), int(lengths.max(initial=0))), dtype=np.int64)
    tokens[np.arange(tokens.shape[1])[None, :] < lengths[:, None]] = np.concatenate(sequences)
    return tokens, lengths
