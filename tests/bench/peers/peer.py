"""PyTorch's own data-parallel tools on the models of zeroshard's benchmarks,
for tests/bench/peers/run.py to run beside ours with the same shapes.

  python peer.py --model gpt|gpt2|mlp --mode ddp|zero|fsdp2 --world 2 --threads 1 --steps 8

or one rank of a job whose ranks another program starts (tests/bench/multihost_bench
starts them on emulated hosts):

  python peer.py ... --rank R --master ADDR:PORT

Starts --world processes (gloo over loopback, like our shard_worker), each with
--threads intra-op threads, trains --steps steps on synthetic data and prints
one JSON line: the median step time (the first step not counted), items per
second over all ranks, CPU time per step, and each rank's peak RSS from /proc
(VmHWM).

Models, as zeroshard builds them:
  mlp: seed 001's: --layers x Linear(--width, --width), no activation, MSE,
       Adam lr 1e-4, --batch rows per rank.
  gpt: the gpt_bench GPT-2 (pre-LayerNorm blocks, GELU tanh, causal attention,
       LM head tied to the token embedding, vocab 256), Adam lr 3e-4,
       --batch sequences of --context bytes per rank.
  gpt2: transformers' GPT2LMHeadModel (GPT2Config with --layers, --heads,
       --d_model, n_positions --context, --vocab; dropout 0), AdamW lr 3e-4,
       --batch windows per rank read from the llm.c token shard --data
       exactly as shard_worker reads them (worker/data/token_shards.h):
       rank r's row i at step s is window (s * world + r) * batch + i (mod
       the windows), tokens [k * context, k * context + context].
Modes:
  ddp:   DistributedDataParallel + torch.optim.Adam (every rank the whole state).
  zero:  DDP + ZeroRedundancyOptimizer(Adam) (optimizer state sharded: ZeRO-1).
  fsdp2: fully_shard on every Linear / block and on the root (ZeRO-3), where
         the installed torch has it.
  fsdp2_hsdp: the same on a 2-D DeviceMesh (replicate x shard): sharded inside
         groups of --shard_group_size consecutive ranks, replicated across
         them (FSDP2's HSDP).
"""
import argparse
import json
import math
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(c, eps=1e-5)
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c, eps=1e-5)
        self.c_fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if hasattr(F, "scaled_dot_product_attention"):  # torch >= 2.0: its fused kernel
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.n_head)
            mask = torch.ones(t, t, dtype=torch.bool).tril()
            y = att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, n_layer, c, n_head, vocab, n_ctx):
        super().__init__()
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(n_ctx, c)
        self.h = nn.ModuleList(Block(c, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(c, eps=1e-5)

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(t))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T  # tied LM head
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def read_token_windows(path, context):
    """The llm.c shard's tokens as a tensor, checked as shard_worker checks them."""
    import array
    import struct
    with open(path, "rb") as f:
        header = f.read(1024)
        magic, version, count = struct.unpack("<3i", header[:12])
        if magic != 20240520 or version != 1:
            sys.exit(f"{path}: not an llm.c token shard (magic {magic}, version {version})")
        tokens = array.array("H")
        tokens.frombytes(f.read(2 * count))
    windows = (count - 1) // context
    if windows < 1:
        sys.exit(f"{path}: {count} tokens hold no window of {context} + 1")
    return torch.tensor(tokens, dtype=torch.long), windows


def shard_batch(tokens, windows, context, first, batch):
    """Rows first .. first + batch - 1 (mod windows): tokens and next-token targets."""
    rows = [tokens[(k % windows) * context:(k % windows) * context + context + 1]
            for k in range(first, first + batch)]
    w = torch.stack(rows)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class HfGpt2(nn.Module):
    """GPT2LMHeadModel with the loss over our targets (not its own label shift)."""

    def __init__(self, args):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        config = GPT2Config(n_layer=args.layers, n_head=args.heads, n_embd=args.d_model,
                            n_positions=args.context, vocab_size=args.vocab, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        self.lm = GPT2LMHeadModel(config)

    def forward(self, tokens, targets):
        logits = self.lm(input_ids=tokens).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def peak_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def fsdp2_mesh(args):
    """None (the default 1-D mesh of every rank) or fsdp2_hsdp's 2-D mesh."""
    if args.mode != "fsdp2_hsdp":
        return None
    from torch.distributed.device_mesh import init_device_mesh
    g = args.shard_group_size
    if g < 1 or args.world % g:
        sys.exit(f"--shard_group_size={g} does not divide --world={args.world}")
    return init_device_mesh("cpu", (args.world // g, g), mesh_dim_names=("replicate", "shard"))


def mlp(args):
    layers = []
    for _ in range(args.layers):
        layers.append(nn.Linear(args.width, args.width))
        if args.activation == "gelu":
            layers.append(nn.GELU(approximate="tanh"))
    return nn.Sequential(*layers)


def worker(rank, args, master, queue):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master.rsplit(":", 1)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    torch.manual_seed(0)
    if args.model == "mlp":
        model = mlp(args)
        lr = 1e-4
        units = [m for m in model if isinstance(m, nn.Linear)]
    elif args.model == "gpt2":
        model = HfGpt2(args)
        lr = 3e-4
        units = list(model.lm.transformer.h)
        tokens, windows = read_token_windows(args.data, args.context)
    else:
        model = Gpt(args.layers, args.d_model, args.heads, 256, args.context)
        lr = 3e-4
        units = list(model.h)
    optimizer_class = torch.optim.AdamW if args.model == "gpt2" else torch.optim.Adam
    if args.mode in ("fsdp2", "fsdp2_hsdp"):
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard
        mesh = fsdp2_mesh(args)
        for unit in units:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = optimizer_class(model.parameters(), lr=lr)
        step_model = model
    else:
        step_model = nn.parallel.DistributedDataParallel(model)
        if args.mode == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, lr=lr)
        else:
            opt = optimizer_class(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1000 + rank)
    times, cpu_times = [], []
    for step in range(args.steps):
        if args.model == "gpt2":
            x, y = shard_batch(tokens, windows, args.context,
                               (step * args.world + rank) * args.batch, args.batch)
        elif args.model == "mlp":
            x = torch.randn(args.batch, args.width, generator=g)
            y = torch.randn(args.batch, args.width, generator=g)
        else:
            x = torch.randint(0, 256, (args.batch, args.context), generator=g)
            y = torch.randint(0, 256, (args.batch, args.context), generator=g)
        dist.barrier()
        start = time.perf_counter()
        cpu_start = time.process_time()
        if args.model == "mlp":
            loss = F.mse_loss(step_model(x), y)
        else:
            loss = step_model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    dist.barrier()
    result = (rank, times[1:], peak_rss_bytes(), cpu_times[1:])
    if queue is None:  # one rank of a job started by another program
        print(json.dumps({"rank": rank, "step_s": result[1], "peak_rss_bytes": result[2],
                          "step_cpu_s": result[3], "torch": torch.__version__,
                          "blas_kernel": torch_blas()}), flush=True)
    else:
        queue.put(result)
    dist.destroy_process_group()


def torch_blas():
    """PyTorch's BLAS and the vector extension its kernels use, from its build config."""
    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    capability = re.search(r"CPU capability usage: (\w+)", config)
    return (f"torch {blas.group(1) if blas else 'unknown BLAS'} "
            f"({capability.group(1) if capability else 'unknown ISA'})")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["mlp", "gpt", "gpt2"], required=True)
    p.add_argument("--mode", choices=["ddp", "zero", "fsdp2", "fsdp2_hsdp"], required=True)
    p.add_argument("--shard_group_size", type=int, default=2, help="fsdp2_hsdp: ranks per group")
    p.add_argument("--activation", choices=["none", "gelu"], default="none", help="mlp")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layers", type=int)
    p.add_argument("--width", type=int, default=2000)
    p.add_argument("--batch", type=int)
    p.add_argument("--d_model", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--vocab", type=int, default=50257, help="gpt2")
    p.add_argument("--data", default="", help="gpt2: an llm.c token shard")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--rank", type=int, default=-1,
                   help="run this one rank here (with --master) and print its JSON line")
    p.add_argument("--master", default="", help="with --rank: rank 0's ADDR:PORT")
    args = p.parse_args()
    if args.layers is None:
        args.layers = 20 if args.model == "mlp" else 6
    if args.batch is None:
        args.batch = 20 if args.model == "mlp" else 4
    if args.mode in ("fsdp2", "fsdp2_hsdp"):
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            try:
                from torch.distributed._composable.fsdp import fully_shard  # noqa: F401
            except ImportError:
                print(json.dumps({"skipped": f"torch {torch.__version__} has no fully_shard"}))
                return
    if args.rank >= 0:
        if not args.master or not 0 <= args.rank < args.world:
            sys.exit(f"--rank={args.rank} needs --master=ADDR:PORT and a rank below --world")
        worker(args.rank, args, args.master, None)
        return
    port = args.port
    if port == 0:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    master = f"127.0.0.1:{port}"
    procs = [ctx.Process(target=worker, args=(r, args, master, queue)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    results = []
    deadline = time.time() + 1800
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=2))
        except Exception:  # queue.Empty: is every rank still alive?
            if time.time() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                for proc in procs:
                    proc.kill()
                sys.exit("a rank failed or the run passed 30 minutes")
    results.sort()
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            sys.exit(f"a rank exited with {proc.exitcode}")
    # A step ends when the slowest rank ends it: the max over ranks, per step.
    step_s = [max(r[1][i] for r in results) for i in range(len(results[0][1]))]
    median = statistics.median(step_s)
    items = args.world * args.batch * (1 if args.model == "mlp" else args.context)
    print(json.dumps({
        "torch": torch.__version__,
        "blas_kernel": torch_blas(),
        "model": args.model,
        "mode": args.mode,
        "world": args.world,
        "threads": args.threads,
        "step_ms": median * 1e3,
        # CPU time of a rank's process per step (all its threads; median over
        # steps, mean over ranks): steadier than wall time on a busy machine.
        "step_cpu_ms": statistics.mean(statistics.median(r[3]) for r in results) * 1e3,
        "items_per_second": items / median,
        "peak_rss_bytes": [r[2] for r in results],
    }))


if __name__ == "__main__":
    main()
