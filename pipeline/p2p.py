"""Point-to-point transport of tensor lists between pipeline ranks (gloo and NCCL alike).

Messages are identified by ``MsgKey(direction, hop, microbatch)``: ``fwd`` carries hop c's
forward list (chunk c -> c+1), ``bwd`` the gradients of that list (c+1 -> c), ``meta`` the
once-per-run shape description of hop c's forward list.

One message per hop per microbatch and direction. A hop's list (``[hidden] + blocks``) travels
as one contiguous byte buffer, one ``isend`` matched by one ``irecv``, as Megatron sends one
tensor per hop. The layout is fixed once per hop from the shapes the ``meta`` message agrees
(:func:`message_layout`): tensors sit in order of decreasing element size, so every offset is
aligned for its dtype without padding, and mixed dtypes need no second message. The sender
packs with one copy (none for a one-tensor message: its bytes are sent in place); the receiver
unpacks into views of the buffer, no copy. Payload bytes are exactly the tensors' bytes, so
the byte accounting is unchanged; a hand-over between two chunks of one rank is not packed.

Why this cannot deadlock, on either backend:
* sends are ``isend`` and are never waited on before the end of the step (gloo completes a
  send only once the receiver has posted the matching receive, so waiting earlier would add
  a dependency the schedule does not have);
* receives are posted ahead (``irecv`` never blocks the host), in each peer's send order, up to
  the next message this rank will need; a rank waits on a receive only when its next compute op
  needs the data, so the engine blocks exactly where :func:`pipeline.schedule.simulate` blocks,
  and that simulation proves every schedule we build completes (including the ring wrap rank
  P-1 -> rank 0). On the first step a receive whose shapes are not yet agreed is posted only
  when it is needed, after its ``meta`` has arrived;
* each rank posts its receives from a peer in the order that peer posts the sends (both
  derive it from the same static schedule), so FIFO matching (NCCL ignores tags) pairs every
  receive with the right send; the unique tag makes gloo pair them even without that;
* on NCCL the host never blocks and never synchronises in the steady state (shapes and layouts
  are known on the host, nothing is read back): ops queue on one stream per communicator, and
  a send and a receive of opposite directions on one stream wait on each other (measured:
  2 x H200 hang on the P=2 ring). ``directional_groups = (up, down)``, two copies of the
  pipeline group, give each direction of a rank pair its own communicator (messages to a
  higher pipeline rank go over ``up``), so each stream is a single ordered channel and the GPU
  follows the same dependencies as the gloo host. The compute stream waits for a receive only
  at :meth:`PipeComm.recv` of the op that needs it.

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


class MessageLayout(NamedTuple):
    """Where each tensor of a hop's list lies in the message's byte buffer.

    specs: the list's tensors in list order; offsets[i]: byte offset of tensor i; nbytes: the
    buffer's length (the sum of the tensors' bytes, no padding); order: list indices in buffer
    order (decreasing element size, stable), which keeps every offset aligned for its dtype.
    """

    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int
    order: tuple[int, ...]


def message_layout(specs: list[TensorSpec]) -> MessageLayout:
    """The fixed layout of a message of ``specs`` (both ends derive it from the agreed specs)."""
    order = tuple(sorted(range(len(specs)), key=lambda i: -specs[i].dtype.itemsize))
    offsets, pos = [0] * len(specs), 0
    for i in order:
        offsets[i] = pos
        pos += specs[i].nbytes
    return MessageLayout(tuple(specs), tuple(offsets), pos, order)


def pack(tensors: list[torch.Tensor], layout: MessageLayout) -> torch.Tensor:
    """``tensors`` (detached) as one ``[layout.nbytes]`` uint8 buffer; one copy, none for one tensor."""
    flat = [tensors[i].detach().reshape(-1).view(torch.uint8) for i in layout.order]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def unpack(buf: torch.Tensor, layout: MessageLayout) -> list[torch.Tensor]:
    """Views of the uint8 ``buf`` as the layout's tensors, in list order (no copy)."""
    return [buf[o:o + s.nbytes].view(s.dtype).view(s.shape) for s, o in zip(layout.specs, layout.offsets)]


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
        self._layouts: dict[int, MessageLayout] = {}      # hop -> byte layout of its messages
        self._mailbox: dict[MsgKey, list[torch.Tensor]] = {}
        self._posted: dict[MsgKey, tuple] = {}             # key -> (work, buffer, layout, start)
        self._sends: list[tuple] = []                      # (work, buffer, record fields)
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

    def is_remote(self, key: MsgKey) -> bool:
        """Whether ``key`` arrives from another rank (else it is a local hand-over)."""
        return self._peer(key, sending=False) != self.rank

    def _peer(self, key: MsgKey, sending: bool) -> int:
        c = key.hop
        to_next = (key.direction != "bwd") == sending
        return (c + 1) % self.P if to_next else c % self.P

    def _tag(self, key: MsgKey) -> int:
        return (key.hop * (self._num_mb + 1) + key.microbatch + 1) * 3 + _DIRS[key.direction]

    def layout(self, hop: int) -> MessageLayout:
        """The agreed byte layout of hop ``hop``'s messages (forward and backward alike)."""
        lay = self._layouts.get(hop)
        if lay is None:
            lay = self._layouts[hop] = message_layout(self.specs[hop])
        return lay

    def tensor_ids(self, key: MsgKey) -> list[str]:
        """Names of a message's tensors, e.g. ``["hidden", "block3"]`` (gradients: ``"grad:"``)."""
        if key.direction == "meta":
            return ["meta"]
        names = (["hidden"] if self.has_hidden.get(key.hop, True) else []) + [
            f"block{b}" for b in self.hop_blocks[key.hop]]
        return names if key.direction == "fwd" else [f"grad:{n}" for n in names]

    def _record(self, kind, key, peer, chunk, ids, nbytes, start, end):
        """ids: the tensor names, or None to name them from ``key`` (only when recording)."""
        if self.recorder is not None:
            self.recorder.add_comm(kind=kind, direction=key.direction, hop=key.hop, chunk=chunk,
                                   microbatch=key.microbatch, peer=peer,
                                   tensor_ids=self.tensor_ids(key) if ids is None else ids,
                                   nbytes=nbytes, start=start, end=end)

    # ---- sending ----------------------------------------------------------------------------
    def send(self, key: MsgKey, tensors: list[torch.Tensor], chunk: int,
             has_hidden: bool | None = None) -> None:
        """Post ``tensors`` (detached here) to the peer of ``key`` as one message; never blocks."""
        specs = [TensorSpec(tuple(t.shape), t.dtype) for t in tensors]
        peer = self._peer(key, sending=True)
        if key.direction == "fwd" and key.hop not in self.specs:
            self.specs[key.hop], self.has_hidden[key.hop] = specs, bool(has_hidden)
            if peer != self.rank:   # a local hand-over needs no handshake
                meta = encode_meta(specs, bool(has_hidden), self.max_tensors[key.hop]).to(self.wire)
                self._post_send(MsgKey("meta", key.hop, -1), meta, chunk, meta.numel() * 8)
        elif specs != self.specs[key.hop]:
            what = "gradients" if key.direction == "bwd" else "tensors"
            raise RuntimeError(f"hop {key.hop} microbatch {key.microbatch}: {what} {specs} differ "
                               f"from the shapes agreed at the first step {self.specs[key.hop]}")
        if peer == self.rank:
            start = time.perf_counter()
            self._mailbox[key] = [t.detach() for t in tensors]
            self._record("send", key, peer, chunk, None, self.layout(key.hop).nbytes,
                         start, time.perf_counter())
            return
        lay = self.layout(key.hop)
        self.bytes_sent += lay.nbytes
        self._post_send(key, pack(tensors, lay), chunk, lay.nbytes)

    def _post_send(self, key: MsgKey, buf: torch.Tensor, chunk: int, nbytes: int) -> None:
        ids = self.tensor_ids(key) if self.recorder is not None else None
        peer = self._peer(key, sending=True)
        start = time.perf_counter()
        grp = self.up if peer > self.rank else self.down
        if self.host_staged:
            buf = buf.to(self.wire)   # waits for the producing kernels
        work = dist.isend(buf, self.global_ranks[peer], group=grp, tag=self._tag(key))
        # Keep the buffer referenced until the send completes: the caller may free its copy.
        self._sends.append((work, buf, dict(kind="send", key=key, peer=peer, chunk=chunk, ids=ids,
                                            nbytes=nbytes, start=start)))

    def finish_sends(self) -> None:
        """Wait for every posted send (end of step: all matching receives are posted by then)."""
        for work, _buf, rec in self._sends:
            work.wait()
            self._record(rec["kind"], rec["key"], rec["peer"], rec["chunk"], rec["ids"], rec["nbytes"],
                         rec["start"], time.perf_counter())
        self._sends = []

    # ---- receiving --------------------------------------------------------------------------
    def _layout_of(self, key: MsgKey, block: bool) -> MessageLayout | None:
        if key.direction == "meta":
            return message_layout([TensorSpec((_meta_len(self.max_tensors[key.hop]),), torch.int64)])
        if key.hop not in self.specs and key.direction == "fwd" and block:
            meta_key = MsgKey("meta", key.hop, -1)
            work, buf, lay, start = self._posted.pop(meta_key)
            work.wait()
            self.specs[key.hop], self.has_hidden[key.hop] = decode_meta(unpack(buf, lay)[0])
            self._record("recv", meta_key, self._peer(key, False), key.hop + 1, ["meta"], lay.nbytes,
                         start, time.perf_counter())
        return self.layout(key.hop) if key.hop in self.specs else None

    def post_until(self, key: MsgKey, block: bool = False) -> bool:
        """Post receives from ``key``'s peer in channel order up to and including ``key``.

        Non-blocking (``block=False``) posting stops at a message whose shapes are not yet
        known (first step); returns whether ``key`` is posted.
        """
        peer = self._peer(key, sending=False)
        if peer == self.rank or key in self._posted or key in self._ready:
            return True
        queue = self._queues[peer]
        while self._qpos[peer] < len(queue):
            nxt = queue[self._qpos[peer]]
            lay = self._layout_of(nxt, block)
            if lay is None:
                if block:
                    raise RuntimeError(f"no agreed shapes for {nxt}: schedule receives a gradient "
                                       "before its forward was sent")
                return False
            buf = torch.empty(lay.nbytes, dtype=torch.uint8, device=self.wire)
            start = time.perf_counter()
            grp = self.up if self.rank > peer else self.down
            work = dist.irecv(buf, self.global_ranks[peer], group=grp, tag=self._tag(nxt))
            self._posted[nxt] = (work, buf, lay, start)
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
        """Wait for ``key``'s tensors (posting its receive first if needed): views of one buffer."""
        if key in self._ready:
            return self._ready.pop(key)
        peer = self._peer(key, sending=False)
        if peer == self.rank:
            start = time.perf_counter()
            tensors = self._mailbox.pop(key)
            self._record("recv", key, peer, chunk, None, self.layout(key.hop).nbytes,
                         start, time.perf_counter())
            return tensors
        self.post_until(key, block=True)
        work, buf, lay, start = self._posted.pop(key)
        work.wait()
        if self.host_staged:
            buf = buf.to(self.device)
        self._record("recv", key, peer, chunk, None, lay.nbytes, start, time.perf_counter())
        return unpack(buf, lay)
