"""Point-to-point transport of tensor lists between pipeline ranks (gloo and NCCL alike).

Messages are identified by ``MsgKey(direction, hop, microbatch)``: ``fwd`` carries hop c's
forward list (chunk c -> c+1), ``bwd`` the gradients of that list (c+1 -> c), ``meta`` the
once-per-run shape description of hop c's forward list.

Why this cannot deadlock, on either backend:
* sends are ``isend`` and are never waited on before the end of the step (gloo completes a
  send only once the receiver has posted the matching receive, so waiting earlier would add
  a dependency the schedule does not have);
* a rank waits on a receive only when its next compute op needs the data, so the engine
  blocks exactly where :func:`pipeline.schedule.simulate` blocks, and that simulation proves
  every schedule we build completes (including the ring wrap rank P-1 -> rank 0);
* each rank posts its receives from a peer in the order that peer posts the sends (both
  derive it from the same static schedule), so FIFO matching (NCCL ignores tags) pairs every
  receive with the right send; the unique tag makes gloo pair them even without that;
* on NCCL the host never blocks: ops queue on one stream per communicator, and a send and a
  receive of opposite directions on one stream wait on each other (measured: 2 x H200 hang
  on the P=2 ring). ``directional_groups = (up, down)``, two copies of the pipeline group,
  give each direction of a rank pair its own communicator (messages to a higher pipeline
  rank go over ``up``), so each stream is a single ordered channel and the GPU follows the
  same dependencies as the gloo host.

``pipeline.p2p_backend=gloo`` sends a GPU model's messages over gloo through host memory: the
schedule then runs exactly as in the CPU tests, at the cost of two copies per message (a
fallback where NCCL p2p misbehaves, not a fast path).
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.distributed as dist

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int8, torch.uint8)
_MAX_NDIM = 6
_DIRS = {"meta": 0, "fwd": 1, "bwd": 2}


class MsgKey(NamedTuple):
    direction: str   # "meta" | "fwd" | "bwd"
    hop: int         # hop c = edge chunk c -> chunk c+1
    microbatch: int  # -1 for meta


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def _meta_len(max_tensors: int) -> int:
    return 2 + max_tensors * (2 + _MAX_NDIM)


def encode_meta(specs: list[TensorSpec], has_hidden: bool, max_tensors: int) -> torch.Tensor:
    """``[has_hidden, n, (dtype_code, ndim, d0..d5) * max_tensors]`` as int64."""
    meta = torch.zeros(_meta_len(max_tensors), dtype=torch.int64)
    meta[0], meta[1] = int(has_hidden), len(specs)
    for i, s in enumerate(specs):
        if len(s.shape) > _MAX_NDIM or s.dtype not in _DTYPES:
            raise ValueError(f"cannot describe tensor {s} in a pipeline message")
        o = 2 + i * (2 + _MAX_NDIM)
        meta[o], meta[o + 1] = _DTYPES.index(s.dtype), len(s.shape)
        meta[o + 2:o + 2 + len(s.shape)] = torch.tensor(s.shape)
    return meta


def decode_meta(meta: torch.Tensor) -> tuple[list[TensorSpec], bool]:
    vals = meta.tolist()
    specs = []
    for i in range(vals[1]):
        o = 2 + i * (2 + _MAX_NDIM)
        specs.append(TensorSpec(tuple(vals[o + 2:o + 2 + vals[o + 1]]), _DTYPES[vals[o]]))
    return specs, bool(vals[0])


class PipeComm:
    """Sends and receives hop messages for one pipeline rank; records every op.

    group: process group of the pipeline (ranks ordered by pipeline rank) or None for P=1,
    in which case every hop is a local hand-over through a mailbox (same code path, no comm).
    hop_blocks[c]: block ids hop c carries (the static plan); a message is
    ``[hidden] + blocks`` with hidden present iff the agreed ``has_hidden[c]``.
    device: where receive buffers live (the model's device; NCCL needs CUDA tensors).
    directional_groups: (up, down) copies of ``group`` for NCCL (see the module docstring).
    """

    def __init__(self, group, pp_size: int, pp_rank: int, num_chunks: int,
                 hop_blocks: tuple[tuple[int, ...], ...], recorder=None, device=None,
                 directional_groups=None):
        self.group, self.P, self.rank, self.C = group, pp_size, pp_rank, num_chunks
        self.up, self.down = directional_groups if directional_groups is not None else (group, group)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        # A gloo channel for a GPU model (``pipeline.p2p_backend=gloo``): messages travel through
        # host memory, sent from a host copy and received into host buffers moved to the device.
        self.host_staged = (group is not None and self.device.type != "cpu"
                            and dist.get_backend(self.up) == "gloo")
        self.wire = torch.device("cpu") if self.host_staged else self.device
        self.global_ranks = dist.get_process_group_ranks(group) if group is not None else [0]
        self.hop_blocks = hop_blocks
        self.max_tensors = [1 + len(h) for h in hop_blocks]
        self.recorder = recorder
        self.specs: dict[int, list[TensorSpec]] = {}     # hop -> agreed forward message spec
        self.has_hidden: dict[int, bool] = {}
        self._mailbox: dict[MsgKey, list[torch.Tensor]] = {}
        self._posted: dict[MsgKey, tuple[list, list[torch.Tensor], float]] = {}
        self._sends: list[tuple[list, list[torch.Tensor], dict]] = []
        self._ready: dict[MsgKey, list[torch.Tensor]] = {}   # received ahead by wait()
        self.bytes_sent = 0  # p2p payload bytes sent to other ranks, cumulative (trainer metrics)
        self._queues: dict[int, list[MsgKey]] = {}
        self._qpos: dict[int, int] = {}
        self._num_mb = 1
        if group is not None and self.P > 1:
            self._connect()

    def _connect(self) -> None:
        """Open every channel the schedule will use, once, in one global order.

        NCCL creates the communicator of a rank pair lazily, at its first send or receive, and
        that creation blocks both hosts until the peer joins. Left to the schedule, rank 0 can
        block opening ``up`` towards rank 1 while rank 1 blocks opening ``down`` towards rank 0.
        Here every rank walks the same sorted list of (direction, sender, receiver) edges and
        completes each of its own before the next, so the first unfinished edge can always
        proceed: no cycle, no deadlock. On gloo this is one tiny message per edge.
        """
        edges = set()
        for c in range(self.C - 1):
            a, b = c % self.P, (c + 1) % self.P
            if a != b:
                edges.update({(a, b), (b, a)})  # forward and backward of hop c
        token = torch.zeros(1, device=self.wire)
        for src, dst in sorted(edges, key=lambda e: (e[1] < e[0], e)):
            grp = self.up if dst > src else self.down
            if self.rank == src:
                dist.isend(token, self.global_ranks[dst], group=grp, tag=1).wait()
            elif self.rank == dst:
                dist.irecv(token, self.global_ranks[src], group=grp, tag=1).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- static channel order -------------------------------------------------------------
    def begin_step(self, schedules, num_microbatches: int) -> None:
        """Derive, from every rank's op list, the order in which each peer sends to us."""
        self._num_mb = num_microbatches
        self._queues, self._qpos = {}, {}
        for src, ops in enumerate(schedules):
            if src == self.rank:
                continue
            queue, announced = [], set()
            for op in ops:
                if op.kind == "F" and op.chunk < self.C - 1 and (op.chunk + 1) % self.P == self.rank:
                    if op.chunk not in self.specs and op.chunk not in announced:
                        queue.append(MsgKey("meta", op.chunk, -1))
                        announced.add(op.chunk)
                    queue.append(MsgKey("fwd", op.chunk, op.microbatch))
                elif op.kind == "B" and op.chunk > 0 and (op.chunk - 1) % self.P == self.rank:
                    queue.append(MsgKey("bwd", op.chunk - 1, op.microbatch))
            self._queues[src], self._qpos[src] = queue, 0

    def _peer(self, key: MsgKey, sending: bool) -> int:
        c = key.hop
        to_next = (key.direction != "bwd") == sending
        return (c + 1) % self.P if to_next else c % self.P

    def _tag(self, key: MsgKey, i: int) -> int:
        return (((key.hop * (self._num_mb + 1) + key.microbatch + 1) * 3 + _DIRS[key.direction]) << 6) + i

    def tensor_ids(self, key: MsgKey) -> list[str]:
        """Names of a message's tensors, e.g. ``["hidden", "block3"]`` (gradients: ``"grad:"``)."""
        if key.direction == "meta":
            return ["meta"]
        names = (["hidden"] if self.has_hidden.get(key.hop, True) else []) + [
            f"block{b}" for b in self.hop_blocks[key.hop]]
        return names if key.direction == "fwd" else [f"grad:{n}" for n in names]

    def _record(self, kind, key, peer, chunk, ids, nbytes, start, end):
        if self.recorder is not None:
            self.recorder.add_comm(kind=kind, direction=key.direction, hop=key.hop, chunk=chunk,
                                   microbatch=key.microbatch, peer=peer, tensor_ids=ids,
                                   nbytes=nbytes, start=start, end=end)

    # ---- sending ----------------------------------------------------------------------------
    def send(self, key: MsgKey, tensors: list[torch.Tensor], chunk: int,
             has_hidden: bool | None = None) -> None:
        """Post ``tensors`` (detached here) to the peer of ``key``; never blocks."""
        bufs = [t.detach().contiguous() for t in tensors]
        specs = [TensorSpec(tuple(b.shape), b.dtype) for b in bufs]
        if key.direction == "fwd":
            if key.hop not in self.specs:
                self.specs[key.hop], self.has_hidden[key.hop] = specs, bool(has_hidden)
                if self._peer(key, sending=True) != self.rank:   # a local hand-over needs no handshake
                    meta = encode_meta(specs, bool(has_hidden), self.max_tensors[key.hop]).to(self.wire)
                    self._post_send(MsgKey("meta", key.hop, -1), [meta], chunk)
            elif specs != self.specs[key.hop]:
                raise RuntimeError(f"hop {key.hop} microbatch {key.microbatch}: tensors {specs} differ "
                                   f"from the shapes agreed at the first step {self.specs[key.hop]}")
        self._post_send(key, bufs, chunk)

    def _post_send(self, key, bufs, chunk):
        ids = self.tensor_ids(key)
        peer = self._peer(key, sending=True)
        start = time.perf_counter()
        nbytes = sum(b.numel() * b.element_size() for b in bufs)
        if key.direction != "meta" and peer != self.rank:
            self.bytes_sent += nbytes
        if peer == self.rank:
            self._mailbox[key] = bufs
            self._record("send", key, peer, chunk, ids, nbytes, start, time.perf_counter())
            return
        dst = self.global_ranks[peer]
        grp = self.up if peer > self.rank else self.down
        if self.host_staged:
            bufs = [b.to(self.wire) for b in bufs]   # waits for the producing kernels
        works = [dist.isend(b, dst, group=grp, tag=self._tag(key, i)) for i, b in enumerate(bufs)]
        # Keep the buffers referenced until the send completes: the caller may free its copy.
        self._sends.append((works, bufs, dict(kind="send", key=key, peer=peer, chunk=chunk, ids=ids,
                                              nbytes=nbytes, start=start)))

    def finish_sends(self) -> None:
        """Wait for every posted send (end of step: all matching receives are posted by then)."""
        for works, _bufs, rec in self._sends:
            for w in works:
                w.wait()
            self._record(rec["kind"], rec["key"], rec["peer"], rec["chunk"], rec["ids"], rec["nbytes"],
                         rec["start"], time.perf_counter())
        self._sends = []

    # ---- receiving --------------------------------------------------------------------------
    def _spec_of(self, key: MsgKey, block: bool) -> list[TensorSpec] | None:
        if key.direction == "meta":
            return [TensorSpec((_meta_len(self.max_tensors[key.hop]),), torch.int64)]
        if key.hop not in self.specs and key.direction == "fwd" and block:
            works, bufs, start = self._posted.pop(MsgKey("meta", key.hop, -1))
            for w in works:
                w.wait()
            self.specs[key.hop], self.has_hidden[key.hop] = decode_meta(bufs[0])
            self._record("recv", MsgKey("meta", key.hop, -1), self._peer(key, False), key.hop + 1,
                         ["meta"], bufs[0].numel() * 8, start, time.perf_counter())
        return self.specs.get(key.hop)

    def post_until(self, key: MsgKey, block: bool = False) -> bool:
        """Post receives from ``key``'s peer in channel order up to and including ``key``.

        Non-blocking (``block=False``) posting stops at a message whose shapes are not yet
        known (first step); returns whether ``key`` is posted.
        """
        peer = self._peer(key, sending=False)
        if peer == self.rank or key in self._posted:
            return True
        queue = self._queues[peer]
        while self._qpos[peer] < len(queue):
            nxt = queue[self._qpos[peer]]
            specs = self._spec_of(nxt, block)
            if specs is None:
                if block:
                    raise RuntimeError(f"no agreed shapes for {nxt}: schedule receives a gradient "
                                       "before its forward was sent")
                return False
            bufs = [torch.empty(s.shape, dtype=s.dtype, device=self.wire) for s in specs]
            src = self.global_ranks[peer]
            start = time.perf_counter()
            grp = self.up if self.rank > peer else self.down
            works = [dist.irecv(b, src, group=grp, tag=self._tag(nxt, i)) for i, b in enumerate(bufs)]
            self._posted[nxt] = (works, bufs, start)
            self._qpos[peer] += 1
            if nxt == key:
                return True
        raise RuntimeError(f"{key} is not in the channel order from rank {peer}")

    def wait(self, key: MsgKey, chunk: int) -> None:
        """Complete ``key``'s receive now; the next :meth:`recv` of it returns at once. The
        engine waits before it starts an op's clock, so compute spans exclude waiting time."""
        if key not in self._ready:
            self._ready[key] = self.recv(key, chunk)

    def recv(self, key: MsgKey, chunk: int) -> list[torch.Tensor]:
        """Wait for ``key``'s tensors (posting its receive first if needed)."""
        if key in self._ready:
            return self._ready.pop(key)
        peer = self._peer(key, sending=False)
        if peer == self.rank:
            start = time.perf_counter()
            bufs = self._mailbox.pop(key)
            self._record("recv", key, peer, chunk, self.tensor_ids(key),
                         sum(b.numel() * b.element_size() for b in bufs), start, time.perf_counter())
            return [b.detach() for b in bufs]
        self.post_until(key, block=True)
        works, bufs, start = self._posted.pop(key)
        for w in works:
            w.wait()
        if self.host_staged:
            bufs = [b.to(self.device) for b in bufs]
        self._record("recv", key, peer, chunk, self.tensor_ids(key),
                     sum(b.numel() * b.element_size() for b in bufs), start, time.perf_counter())
        return bufs
