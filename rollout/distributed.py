"""Data-parallel rollouts: the processes `accelerate launch` (torch.distributed) starts, each with its own generator.

A run of N processes ("ranks") splits each rollout's prompt groups between them (a group never split), balanced by
expected work (`shard_groups`); each rank generates its share on its own device; the finished responses are
all-gathered once per rollout so that every rank's suffix drafter learns from the whole run (`share_responses`).
One process (no `WORLD_SIZE` above 1 in the environment) is `Ranks()`: rank 0 of 1, every collective a no-op.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence

import numpy as np

FAILURE_KEY = "rollout/failure"  # the first rank to fail writes "rank R: cause" here; the other ranks read it
BALANCES = ("work", "count")
VANISHED = "its process ended without a word (killed: SIGKILL, or out of memory?)"


class RankStopped(Exception):
    """This rank stops because another rank failed; that rank reports the cause (`Ranks.failure()`)."""


class Ranks:
    """This process's place in a data-parallel run and the few collectives the run uses (over torch.distributed:
    gloo on CPU, NCCL on GPUs). With `world_size` 1 every collective returns at once."""

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def device(self, requested: str) -> str:
        """The device this rank runs on: "cuda" (or "auto" on a GPU machine) becomes this rank's own GPU."""
        if not self.distributed or requested.startswith("cuda:") or requested == "cpu":
            return requested
        if requested in ("cuda", "auto") and _torch().cuda.is_available():
            return f"cuda:{self.local_rank}"
        return requested

    def all_gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        _torch().distributed.all_gather_object(out, obj)
        return out

    def gather(self, obj) -> list | None:
        """Every rank's `obj`, in rank order, on rank 0 (None on the others)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size if self.is_main else None
        _torch().distributed.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        _torch().distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            _torch().distributed.barrier()

    def exit_process(self) -> None:
        """End this rank's process once its run has succeeded (every output written and closed): meet the other ranks at
        a barrier (every rank's collectives are done, and no rank touches the launcher's store afterwards), flush the
        standard streams, and exit with status 0 at once, without Python's shutdown. There, torch.distributed's threads
        (gloo's workers, the TCP store) are torn down and can abort a finished process with SIGABRT ("terminate called
        without an active exception"), even after `destroy_process_group`. A peer that failed after this rank's last
        collective ends the barrier with an error: the peer reports its failure, this rank's own run stands. One
        process: returns at once."""
        if not (self.distributed and _torch().distributed.is_initialized()):
            return
        try:
            _torch().distributed.barrier()
        except Exception:  # the peer is gone (gloo: connection closed): its own exit says why
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def claim_failure(self, cause: str, rank: int | None = None) -> bool:
        """Record "rank R: cause" (R: this rank, or `rank`) as the run's failure unless a failure was recorded first;
        True when this one is recorded (so this process is the one that reports it)."""
        store = self._store()
        if store is None:
            return True
        mine = f"rank {self.rank if rank is None else rank}: {cause}"
        try:
            return store.compare_set(FAILURE_KEY, "", mine).decode() == mine
        except Exception:  # the store went away with the launcher: report it here
            return True

    def failure(self) -> str | None:
        """The failure another rank recorded ("rank R: cause"), or None."""
        store = self._store()
        try:
            if store is not None and store.check([FAILURE_KEY]):
                return store.get(FAILURE_KEY).decode()
        except Exception:
            return None
        return None

    def stop_cause(self, wait: float = 1.0) -> str | None:
        """Why another rank stopped the run ("rank R: cause"): the failure it recorded, or its process gone without
        a word; None when no other rank is known to have failed. Looks again for up to `wait` seconds: a peer's
        socket closes a moment before its process is seen dead."""
        deadline = time.monotonic() + wait
        while True:
            failure = self.failure()
            if failure is not None:
                return None if failure.startswith(f"rank {self.rank}:") else failure
            gone = self.vanished()
            if gone:
                return f"rank {gone[0]}: {VANISHED}"
            if time.monotonic() >= deadline or not self.distributed:
                return None
            time.sleep(0.05)

    def register(self) -> None:
        """Record this rank's host and process id, so that a rank whose process vanishes can be named."""
        store = self._store()
        if store is not None:
            store.set(f"rollout/pid/{self.rank}", f"{socket.gethostname()} {os.getpid()}")

    def mark_exit(self) -> None:
        """Record that this rank's process ends on its own (an error or a signal it handled), not killed."""
        store = self._store()
        try:
            if store is not None:
                store.set(f"rollout/exit/{self.rank}", "1")
        except Exception:  # the launcher's store is gone: nothing to tell
            pass

    def vanished(self) -> list[int]:
        """Ranks on this machine whose process is gone without `mark_exit`: killed (SIGKILL, out of memory)."""
        store, host, gone = self._store(), socket.gethostname(), []
        if store is None:
            return gone
        for rank in range(self.world_size):
            try:
                if rank == self.rank or store.check([f"rollout/exit/{rank}"]):
                    continue
                if not store.check([f"rollout/pid/{rank}"]):
                    continue
                where, pid = store.get(f"rollout/pid/{rank}").decode().split()
            except Exception:
                continue
            if where == host and not _alive(int(pid)):
                gone.append(rank)
        return gone

    def _store(self):
        if not (self.distributed and _torch().distributed.is_initialized()):
            return None
        return _torch().distributed.distributed_c10d._get_default_store()


def start_ranks(cpu: bool | None = None) -> Ranks:
    """The run's ranks from the environment `accelerate launch` (or torchrun) sets: one process without it. Starts
    torch.distributed through accelerate: NCCL where there is a GPU, gloo on a CPU machine or with `cpu`."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Ranks()
    from accelerate import PartialState

    state = PartialState(cpu=not _torch().cuda.is_available() if cpu is None else cpu)
    ranks = Ranks(state.process_index, state.num_processes, state.local_process_index)
    ranks.register()
    return ranks


def ranks_of(accelerator) -> Ranks:
    """The ranks of an `accelerate.Accelerator` (or `PartialState`) that a trainer already started."""
    return Ranks(accelerator.process_index, accelerator.num_processes, accelerator.local_process_index)


def shard_groups(costs: Sequence[float], num_ranks: int, balance: str = "work") -> list[list[int]]:
    """Which prompt groups each rank generates: `balance="work"` hands the costliest group still unplaced to the
    least loaded rank (longest-processing-time first); "count" cuts the groups into contiguous blocks of equal count
    (what a split by count alone gives). Each rank's groups come back in ascending order; every group exactly once.

    Args:
        costs: `[num_groups]` the expected work of each group (`group_costs`).
        num_ranks: the number of ranks.
    """
    if balance not in BALANCES:
        raise ValueError(f"distributed.balance ({balance!r}) must be one of {', '.join(BALANCES)}")
    num_groups = len(costs)
    if balance == "count":
        return [block.tolist() for block in np.array_split(np.arange(num_groups), num_ranks)]
    load = [0.0] * num_ranks
    shards: list[list[int]] = [[] for _ in range(num_ranks)]
    for group in sorted(range(num_groups), key=lambda g: (-costs[g], g)):
        rank = min(range(num_ranks), key=lambda r: (load[r], len(shards[r]), r))
        shards[rank].append(group)
        load[rank] += costs[group]
    return [sorted(s) for s in shards]


class OutputLengths:
    """Completion lengths seen so far per prompt (by its token ids): the cheap predictor of a group's work."""

    def __init__(self):
        self._sum: dict[bytes, float] = {}
        self._count: dict[bytes, int] = {}

    def add(self, prompt_ids: Sequence[Sequence[int]], lengths: Sequence[int]) -> None:
        for ids, length in zip(prompt_ids, lengths):
            key = prompt_key(ids)
            self._sum[key] = self._sum.get(key, 0.0) + float(length)
            self._count[key] = self._count.get(key, 0) + 1

    def expected(self, prompt_ids: Sequence[int]) -> float | None:
        key = prompt_key(prompt_ids)
        return self._sum[key] / self._count[key] if key in self._count else None

    def mean(self) -> float:
        """The mean over every completion seen (0.0 before any)."""
        total = sum(self._count.values())
        return sum(self._sum.values()) / total if total else 0.0


def group_costs(
    prompt_ids: Sequence[Sequence[int]], n: int, lengths: OutputLengths | None = None, prior: float = 0.0
) -> list[float]:
    """Each group's expected work in tokens: `n * (prompt length + expected completion length)`. A prompt seen in an
    earlier rollout expects the mean length of its earlier completions, an unseen one the mean over all seen, and
    `prior` (e.g. the token cap) before any is seen. A prompt token and a completion token count alike: each is one
    position of a forward at full batch."""
    mean = lengths.mean() if lengths is not None and lengths.mean() > 0 else prior
    costs = []
    for ids in prompt_ids:
        expected = lengths.expected(ids) if lengths is not None else None
        costs.append(float(n) * (len(ids) + (mean if expected is None else expected)))
    return costs


def pack_responses(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> dict:
    """Finished responses as a few int32 arrays (each distinct prompt once): what `share_responses` sends."""
    keys: dict[bytes, int] = {}
    prompts = []
    which = np.empty(len(completion_ids), dtype=np.int32)
    for i, ids in enumerate(prompt_ids):
        key = prompt_key(ids)
        if key not in keys:
            keys[key] = len(prompts)
            prompts.append(ids)
        which[i] = keys[key]
    return {
        "prompt_lengths": np.array([len(p) for p in prompts], dtype=np.int32),
        "prompt_tokens": np.array([t for p in prompts for t in p], dtype=np.int32),
        "prompt_of": which,
        "lengths": np.array([len(c) for c in completion_ids], dtype=np.int32),
        "tokens": np.array([t for c in completion_ids for t in c], dtype=np.int32),
    }


def unpack_responses(packed: dict) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, completion ids) of each response `pack_responses` packed."""
    prompts = np.split(packed["prompt_tokens"], np.cumsum(packed["prompt_lengths"])[:-1])
    prompts = [p.tolist() for p in prompts] if len(packed["prompt_lengths"]) else []
    completions = np.split(packed["tokens"], np.cumsum(packed["lengths"])[:-1]) if len(packed["lengths"]) else []
    return [prompts[i] for i in packed["prompt_of"].tolist()], [c.tolist() for c in completions]


def gather_responses(
    ranks: Ranks, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]
) -> tuple[list[tuple[list[list[int]], list[list[int]]]], int]:
    """All-gather every rank's finished responses of one rollout (every rank must call it).

    Returns:
        each rank's (prompt ids, completion ids), in rank order, and the bytes this rank sent.
    """
    packed = pack_responses(prompt_ids, completion_ids)
    return [unpack_responses(item) for item in ranks.all_gather(packed)], int(sum(a.nbytes for a in packed.values()))


def add_others(ranks: Ranks, history, every: list, prompts: set[bytes] | None = None) -> int:
    """Add the other ranks' responses of `gather_responses` to `history` (the suffix drafter's,
    `Generator.draft_history`; this rank's own are there already): all of them, or those to the prompts whose
    `prompt_key` is in `prompts`. Returns the number added."""
    added = 0
    for rank, (prompt_ids, completion_ids) in enumerate(every):
        if rank == ranks.rank:
            continue
        keep = [i for i, ids in enumerate(prompt_ids) if prompts is None or prompt_key(ids) in prompts]
        if keep:
            history.add_responses([prompt_ids[i] for i in keep], [completion_ids[i] for i in keep])
            added += len(keep)
    return added


def share_responses(
    ranks: Ranks, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], history=None
) -> tuple[list[list[int]], list[list[int]], int]:
    """All-gather every rank's finished responses of one rollout and add the other ranks' to `history`. Every rank
    must call it.

    Returns:
        (prompt ids, completion ids) of every rank's responses, rank by rank, and the bytes this rank sent.
    """
    every, sent = gather_responses(ranks, prompt_ids, completion_ids)
    if history is not None:
        add_others(ranks, history, every)
    return [p for prompts, _ in every for p in prompts], [c for _, completions in every for c in completions], sent


def _alive(pid: int) -> bool:
    """Whether process `pid` runs: a killed one is gone, or a zombie until its launcher reaps it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: the signal test is all there is
    return state not in ("Z", "X")


def _torch():
    import torch  # imported on first use: `rollout --help` and a bad recipe answer before torch loads

    return torch


def prompt_key(ids: Sequence[int]) -> bytes:
    """A prompt's token ids as bytes: the key of its earlier lengths and of its history."""
    return np.asarray(ids, dtype=np.int32).tobytes()


@contextlib.contextmanager
def signals_ignored():
    """SIGTERM and SIGINT ignored inside the block (main thread): a stopping rank finishes its last writes."""
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        while sig not in previous:
            try:
                previous[sig] = signal.signal(sig, signal.SIG_IGN)
            except KeyboardInterrupt:
                # a signal that came before the block: `signal.signal` runs a pending one's handler first (here
                # `Terminated` out of a stopping rank's last writes, as a traceback); the stop it asks for is under way
                continue
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def signal_behind(err: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt (Ctrl-C, or SIGTERM's Terminated) that `err` is or that caused it (`raise ... from`). A
    signal's handler runs between any two bytecodes, and where that is inside a callback of compiled code (numba's
    `_numba_unpickle` inside the suffix proposer's kernels, for one), the extension raises a SystemError from the
    interrupt: still a signal, not a failure of the run. An error raised while a signal was being handled (its
    `__context__` only) is that error."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return err
        seen.add(id(err))
        err = err.__cause__
    return None
