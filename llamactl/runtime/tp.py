"""Tensor parallelism over torch.distributed: one model across the processes of a group.

As gpt-fast and Megatron split a LLaMA: q/k/v and gate/up are column-parallel (each rank holds
its heads' rows, its slice of the intermediate features), o_proj and down_proj row-parallel
(the matching input columns), and their outputs are summed over the group with one all-reduce
each (model.add_linear). Embeddings, norms and lm_head are replicated, so every rank computes
the same logits and samples the same token. KV heads are split with their query heads; when
they do not divide by the world size, each rank keeps the KV heads its query heads read
(replicated across ranks) and the plan says so.

Each rank reads only its slices of the safetensors files (safe_open's get_slice), never the
whole model. GPTQ layers shard too: column-parallel along the output (whole words of packed
zero points), row-parallel along the input at group boundaries (act-order checkpoints are
refused: their groups are spread over the input).

Processes come from torchrun (`torchrun --nproc-per-node N -m llamactl generate ... --tp N`) or
from `--tp N` alone, which starts them itself with torchrun's variables (launch()). `serve --tp N`:
rank 0 serves HTTP and schedules, and sends each model action to the other ranks (send/receive
over a gloo group), which follow it (serve.engine.Engine.follow).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import torch

from llamactl.errors import InputError

COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `world` holds: query heads [heads), KV heads [kv), intermediate [ffn)."""

    rank: int
    world: int
    heads: tuple[int, int]
    kv: tuple[int, int]
    ffn: tuple[int, int]
    kv_replicated: bool

    def describe(self) -> dict[str, Any]:
        return {"world_size": self.world, "rank": self.rank, "query_heads": list(self.heads),
                "kv_heads": list(self.kv), "intermediate": list(self.ffn), "kv_heads_replicated": self.kv_replicated,
                "embeddings": "replicated", "lm_head": "replicated"}


def plan_shard(args, rank: int, world: int, group_size: int | None = None, pack: int = 1) -> Shard:
    """The shard of `rank`; InputError when the model does not split `world` ways. group_size and
    pack: a quantized checkpoint's groups and values per packed word, which slices must respect."""
    h, kv, ffn = args.num_attention_heads, args.num_key_value_heads, args.intermediate_size
    where = f"--tp {world}"
    if h % world:
        raise InputError(f"{where}: {h} attention heads do not split {world} ways", f"use a --tp that divides {h}")
    hq, rep = h // world, h // kv
    if kv % world == 0:
        kv_range, replicated = (rank * kv // world, (rank + 1) * kv // world), False
    elif rep % hq == 0:  # this rank's query heads all read one KV head: keep it (replicated)
        kv_range, replicated = (rank * hq // rep, rank * hq // rep + 1), True
    else:
        raise InputError(f"{where}: {hq} query heads a rank do not cover whole groups of {rep} sharing a KV head",
                         f"use a --tp that divides {kv} or whose query heads a rank divide {rep}")
    unit = max(group_size or 1, pack)
    if ffn % (world * unit):
        raise InputError(f"{where}: the {ffn} intermediate features do not split {world} ways in whole units of {unit}",
                         "use a smaller --tp")
    if (hq * args.head_dim) % unit or (((kv_range[1] - kv_range[0]) * args.head_dim) % pack):
        raise InputError(f"{where}: a rank's attention width does not hold whole quantization groups of {unit}",
                         "use a smaller --tp")
    per = ffn // world
    return Shard(rank, world, (rank * hq, (rank + 1) * hq), kv_range, (rank * per, (rank + 1) * per), replicated)


def local_args(args, shard: Shard):
    """The LlamaArgs of one rank's model: its heads and intermediate features, the same width."""
    return dataclasses.replace(args, num_attention_heads=shard.heads[1] - shard.heads[0],
                               num_key_value_heads=shard.kv[1] - shard.kv[0],
                               intermediate_size=shard.ffn[1] - shard.ffn[0], head_dim=args.head_dim)


def _range(module: str, shard: Shard, d: int) -> tuple[int, int]:
    """The rows (column-parallel) or input columns (row-parallel) of `module` this rank holds."""
    if module.endswith("q_proj") or module.endswith("o_proj"):
        return shard.heads[0] * d, shard.heads[1] * d
    if module.endswith(("k_proj", "v_proj")):
        return shard.kv[0] * d, shard.kv[1] * d
    return shard.ffn


def slices(name: str, shape: tuple[int, ...], shard: Shard, d: int, bits: int | None,
           group: int | None) -> tuple[slice, ...] | None:
    """The slice of checkpoint tensor `name` (shape as stored) this rank reads; None: all of it."""
    module, _, leaf = name.rpartition(".")
    kind = next((k for k in COLUMN + ROW if module.endswith(k)), None)
    if kind is None:
        return None  # embeddings, norms, lm_head: replicated
    a, b = _range(kind, shard, d)
    every = slice(None)
    if kind in COLUMN:  # along the outputs
        if leaf in ("weight", "bias"):
            return (slice(a, b),) + (every,) * (len(shape) - 1)
        if leaf in ("qweight", "scales"):
            return every, slice(a, b)
        if leaf == "qzeros":
            per = 32 // bits
            return every, slice(a // per, b // per)
        return None  # g_idx: the input is whole
    if leaf == "weight":  # row-parallel, along the inputs
        return every, slice(a, b)
    if leaf == "bias":  # added once: rank 0 keeps it, the others add zeros
        return None
    if leaf == "qweight":
        per = 32 // bits
        return slice(a // per, b // per), every
    if leaf in ("qzeros", "scales"):
        g = group if group and group > 0 else None
        return (slice(a // g, b // g), every) if g else None
    if leaf == "g_idx":
        return (slice(a, b),)
    return None


def group_of(art) -> tuple[int | None, int | None]:
    q = art.quantization
    if not q:
        return None, None
    if q.get("quant_method") != "gptq":
        raise InputError(f"{art.path}: --tp reads 16-bit and GPTQ-format checkpoints, not {q.get('quant_method')}",
                         "quantize with --method rtn or gptq, or run it on one process")
    if q.get("desc_act"):
        raise InputError(f"{art.path}: an act-order (desc_act) checkpoint's groups are spread over each input",
                         "--tp splits inputs at group boundaries: quantize with --no-desc-act")
    return int(q["bits"]), int(q.get("group_size", 128))


def shard_offset(name: str, shard: Shard, d: int) -> int:
    module = name.rpartition(".")[0]
    kind = next(k for k in COLUMN + ROW if module.endswith(k))
    return _range(kind, shard, d)[0]


# -- processes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    group: Any
    backend: str
    control: Any = None  # a gloo group for host messages (serve: the leader's step orders)


def join(tp: int, device: torch.device) -> World | None:
    """Join the process group torchrun set up (None for --tp 1); InputError when it does not match."""
    import torch.distributed as dist

    if tp == 1:
        return None
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size != tp:
        raise InputError(f"--tp {tp} runs in {size} process(es)", f"launch with torchrun --nproc-per-node {tp}, or give --tp alone")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend)
        # left to the interpreter's exit, gloo's threads are torn down still joinable and abort the rank
        atexit.register(_leave)
    control = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    return World(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, backend, control)


def send(message: Any, world: World) -> None:
    """Rank 0: give every other rank `message` (a small picklable value: a serving step's order)."""
    import torch.distributed as dist

    dist.broadcast_object_list([message], src=0, group=world.control)


def smallest(value: int, world: World) -> int:
    """The smallest of every rank's value (each rank sizes its own KV pool from its own free
    memory; the leader's block ids must exist on every rank)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=world.control)
    return int(t)


def receive(world: World) -> Any:
    """Ranks above 0: the next message rank 0 sends."""
    import torch.distributed as dist

    box = [None]
    dist.broadcast_object_list(box, src=0, group=world.control)
    return box[0]


def _leave(wait_s: float = 20.0) -> None:
    """Tear the group down at exit, after every rank has checked in at the store (bounded by
    `wait_s`: a rank that failed or was stopped is not waited for): a rank tearing down its
    connections while another still runs aborts that one (gloo: a thread destroyed joinable)."""
    import time

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        arrived, end = store.add("llamactl/leaving", 1), time.monotonic() + wait_s
        while arrived < dist.get_world_size() and time.monotonic() < end:
            time.sleep(0.02)
            arrived = store.add("llamactl/leaving", 0)
    except Exception:  # noqa: BLE001 - the store's host already left: nothing to wait for
        pass
    dist.destroy_process_group()


def shared_seed() -> int:
    """A random seed drawn on rank 0 and given to every rank."""
    import random

    import torch.distributed as dist

    box = [random.getrandbits(63) if dist.get_rank() == 0 else 0]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def under_launcher() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def launch(tp: int, argv: list[str]) -> int:
    """Run this command in `tp` processes, as torchrun would start them (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT, LOCAL_RANK), and return the first failing exit status (0 when all succeed).
    SIGTERM goes to rank 0 alone, which ends the others (a server: its followers, after draining);
    when a rank fails, the others are stopped rather than left waiting in a collective."""
    import signal
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # one thread a process would waste the CPU's cores: they are shared out instead
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // tp)))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(tp),
               LOCAL_WORLD_SIZE=str(tp), OMP_NUM_THREADS=threads)
    procs = [subprocess.Popen([sys.executable, "-m", "llamactl", *argv], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(tp)]
    previous = signal.signal(signal.SIGTERM, lambda *_: procs[0].send_signal(signal.SIGTERM))
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):  # one failed: the rest cannot finish
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
            time.sleep(0.1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return next((p.returncode for p in procs if p.returncode), 0)


def plan_synthetic(args, quant: str, rank: int, world: int) -> Shard:
    """The shard of a --synthetic shape's args, quantized in memory as bench_targets does it
    (int4: RTN groups of 128 in 8-value words)."""
    int4 = quant == "int4"
    return plan_shard(args, rank, world, 128 if int4 else None, 8 if int4 else 1)


def check_shard_fits(art, world: int) -> None:
    """InputError, before any process starts, when the model does not split `world` ways."""
    bits, group_size = group_of(art)
    for rank in range(world):
        plan_shard(art.args, rank, world, group_size if bits else None, 32 // bits if bits else 1)

