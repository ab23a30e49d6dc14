#!/usr/bin/env python3
"""PyTorch FSDP2 (fully_shard) beside tests/gpu/cuda_gpt_bench: the same GPTs
on the same GPU, W = 1, same batch, optimizer (AdamW, lr 3e-4, clip 1.0) and
random tokens; tokens/s and peak device memory as JSON with cuda_gpt_bench's
keys.

The model is written here (no transformers dependency) with Hugging Face
GPT-2's architecture and tensor layout: pre-LayerNorm blocks, tanh GELU, tied
LM head, no dropout. Every block and the root are fully_shard-ed (FSDP2);
bf16 means MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32),
f32 no policy (and TF32 off, as cuBLAS runs zeroshard's f32 products).
Attention is F.scaled_dot_product_attention (flash / memory-efficient
kernels; --attention=math picks PyTorch's unfused path instead). Eager by
default; --compile adds torch.compile (its compile time falls in the warm-up
steps, so give it a few).

  python3 tests/gpu/torch_fsdp_gpt2.py [--models=gpt_bench,gpt2_124m]
      [--dtypes=f32,bf16] [--steps=10] [--warmup=3] [--attention=sdpa|math]
      [--compile] [--json_out=FILE]

Needs torch >= 2.4 with CUDA and one GPU; exits 3 (with a message) when
either is missing, so tests/gpu/run.sh can report the step as skipped.
"""

import argparse
import json
import math
import os
import sys
import time

MODELS = {
    # name: (n_layer, n_head, n_embd, vocab, n_ctx, batch)
    "gpt_bench": (6, 6, 384, 256, 128, 4),
    "gpt2_124m": (12, 12, 768, 50257, 1024, 8),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt_bench,gpt2_124m")
    parser.add_argument("--dtypes", default="f32,bf16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--attention", choices=["sdpa", "math"], default="sdpa")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the FSDP2 model (compile time is in the warm-up)")
    parser.add_argument("--json_out", default="")
    args = parser.parse_args()

    try:
        import torch
        import torch.distributed as dist
        import torch.nn as nn
        import torch.nn.functional as F
    except ImportError as e:
        print(f"torch_fsdp_gpt2: PyTorch is not installed ({e})", file=sys.stderr)
        return 3
    # Old releases may fail to import these modules with other errors than
    # ImportError (torch 1.13 on Python 3.11 raises ValueError).
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # torch >= 2.6
    except Exception:
        try:
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        except Exception:
            print(f"torch_fsdp_gpt2: torch {torch.__version__} has no FSDP2 fully_shard "
                  "(needs >= 2.4)", file=sys.stderr)
            return 3
    if not torch.cuda.is_available():
        print(f"torch_fsdp_gpt2: torch {torch.__version__} sees no CUDA device "
              f"(torch.version.cuda={torch.version.cuda})", file=sys.stderr)
        return 3

    class Block(nn.Module):
        def __init__(self, c, nh):
            super().__init__()
            self.nh = nh
            self.ln_1 = nn.LayerNorm(c)
            self.c_attn = nn.Linear(c, 3 * c)
            self.attn_proj = nn.Linear(c, c)
            self.ln_2 = nn.LayerNorm(c)
            self.c_fc = nn.Linear(c, 4 * c)
            self.mlp_proj = nn.Linear(4 * c, c)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, self.nh, c // self.nh).transpose(1, 2) for z in (q, k, v))
            if args.attention == "math":
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel(SDPBackend.MATH):
                    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class Gpt(nn.Module):
        def __init__(self, n_layer, nh, c, vocab, n_ctx):
            super().__init__()
            self.wte = nn.Embedding(vocab, c)
            self.wpe = nn.Embedding(n_ctx, c)
            self.h = nn.ModuleList(Block(c, nh) for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(c)
            # GPT-2 init, as zeroshard's model zoo: N(0, 0.02), the residual
            # projections N(0, 0.02 / sqrt(2 n_layer)), biases 0.
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                elif "ln_" in name:
                    nn.init.ones_(p)
                elif name.endswith("proj.weight"):
                    nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
                else:
                    nn.init.normal_(p, 0.0, 0.02)

        def forward(self, tokens, targets):
            t = tokens.shape[1]
            x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
            for block in self.h:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.t()  # tied LM head
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    results = []
    for name in args.models.split(","):
        if name not in MODELS:
            print(f"torch_fsdp_gpt2: unknown model '{name}' (expected {', '.join(MODELS)})",
                  file=sys.stderr)
            return 2
        n_layer, nh, c, vocab, n_ctx, batch = MODELS[name]
        for dtype in args.dtypes.split(","):
            if dtype not in ("f32", "bf16"):
                print(f"torch_fsdp_gpt2: --dtypes: '{dtype}' is not f32 or bf16", file=sys.stderr)
                return 2
            torch.manual_seed(1)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            model = Gpt(n_layer, nh, c, vocab, n_ctx).to(device)
            kwargs = {}
            if dtype == "bf16":
                kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                           reduce_dtype=torch.float32)
            for block in model.h:
                fully_shard(block, **kwargs)
            fully_shard(model, **kwargs)
            params = sum(p.numel() for p in model.parameters())
            step_model = torch.compile(model) if args.compile else model
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=1e-2)
            gen = torch.Generator(device=device).manual_seed(7)
            print(f"{name} {dtype} ...", file=sys.stderr)
            start = time.perf_counter()
            loss = None
            for step in range(args.warmup + args.steps):
                if step == args.warmup:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                tokens = torch.randint(0, vocab, (batch, n_ctx), device=device, generator=gen)
                targets = torch.randint(0, vocab, (batch, n_ctx), device=device, generator=gen)
                loss = step_model(tokens, targets)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            results.append({
                "model": name, "parameters": params, "n_layer": n_layer, "n_embd": c,
                "n_head": nh, "vocab": vocab, "context": n_ctx, "batch": batch,
                "dtype": dtype, "stage": "fsdp2", "compiled": args.compile,
                "tokens_per_second": args.steps * batch * n_ctx / seconds,
                "step_ms": 1e3 * seconds / args.steps,
                "device_peak_bytes": torch.cuda.max_memory_reserved(),
                "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
                "last_loss": float(loss),
            })
            r = results[-1]
            print(f"{name:10s} {params / 1e6:6.1f}M {dtype:4s} {r['tokens_per_second']:10.0f} tokens/s "
                  f"{r['step_ms']:8.1f} ms/step  peak reserved {r['device_peak_bytes'] / 2**30:.2f} GiB "
                  f"allocated {r['max_memory_allocated_bytes'] / 2**30:.2f} GiB")
            del model, step_model, opt
    out = {"framework": f"torch {torch.__version__} FSDP2 fully_shard"
                        + (" + torch.compile" if args.compile else ""),
           "device": torch.cuda.get_device_name(0), "world_size": 1,
           "attention": args.attention, "results": results}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
