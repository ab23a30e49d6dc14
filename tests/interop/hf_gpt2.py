"""The Hugging Face side of hf_gpt2_test.cc, with `transformers` from PyPI.

  hf_gpt2.py make DIR
      A randomly initialised GPT2LMHeadModel (2 layers, width 128, 4 heads,
      256 positions, vocabulary 50,257, no dropout) saved with save_pretrained
      to DIR/hf, and llm.c token shards DIR/train_000.bin, DIR/train_001.bin,
      DIR/val_000.bin of seeded random tokens.
  hf_gpt2.py same HF_DIR OUT_DIR
      OUT_DIR loads with from_pretrained without missing or unexpected keys
      and its tensors are bitwise those of HF_DIR.
  hf_gpt2.py train HF_DIR OUT_DIR EVAL_JSON DATA_GLOB WORLD BATCH CONTEXT STEPS LR
      The same AdamW steps in PyTorch (float64) from HF_DIR on the windows the
      workers trained on; the parameters of OUT_DIR (the workers' result, in
      float32) must match within the error model below, and OUT_DIR, loaded
      with from_pretrained, must give the validation loss in EVAL_JSON.

Error model of the parameter check. The reference runs in float64 (exact for
this purpose). The workers compute in float32 (unit roundoff u = 2^-24); a
gradient is made of sums of at most K = WORLD * BATCH * CONTEXT products
(weight gradients sum over every position, and K exceeds the inner widths
C = 128 and 4C), so its relative error is at most about gamma(K) = K u / (1 - K u)
(error_model.py). Adam divides
each element's moments by the element's own RMS: the update carries the
gradient's relative error, amplified at most 1 / (1 - beta1) = 10 times by
the first moment. Per tensor, over the change of the parameters Delta:

  ||Delta_workers - Delta_torch|| / ||Delta_torch||  <=  10 * gamma(K)  (6.1e-4)

One exception: the key third of each c_attn.bias has a gradient of exactly
zero in exact arithmetic (adding a constant to every key's score leaves the
softmax unchanged), so what float32 computes for it is rounding noise alone,
which Adam scales up to updates of up to lr per step in either sign. Those
elements are only checked to move no more than Adam can: steps * lr (+ the
weight decay's lr * 0.01 * |p| per step, far below).

Validation loss: the workers' float32 logits are sums of C = 128 products
after 2 blocks; each logit's error is below (C * (2 * layers + 1)) * u * |z|
with |z| <= ~4 here, 1.6e-4 at the very worst, and the loss (logsumexp minus
a logit, averaged) at most twice that: 3.2e-4, against a float64 reference.
"""
import glob
import json
import math
import sys

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel

from error_model import gamma

MAGIC, VERSION = 20240520, 1


def write_shard(path, tokens):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [MAGIC, VERSION, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


def read_stream(paths):
    return np.concatenate(
        [np.fromfile(p, dtype=np.uint16, offset=1024) for p in sorted(paths)]).astype(np.int64)


def make(out):
    torch.manual_seed(1234)
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=256, vocab_size=50257,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    GPT2LMHeadModel(config).save_pretrained(f"{out}/hf")
    rng = np.random.default_rng(5)
    write_shard(f"{out}/train_000.bin", rng.integers(0, 50257, 1500))
    write_shard(f"{out}/train_001.bin", rng.integers(0, 50257, 1500))
    write_shard(f"{out}/val_000.bin", rng.integers(0, 50257, 2100))


def load_checked(out_dir):
    model, info = GPT2LMHeadModel.from_pretrained(out_dir, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"from_pretrained({out_dir}): {bad}"
    return model


def same(hf_dir, out_dir):
    load_checked(out_dir)
    a = load_file(f"{hf_dir}/model.safetensors")
    b = {}
    for path in glob.glob(f"{out_dir}/*.safetensors"):
        b.update(load_file(path))
    assert set(a) == set(b), f"names differ: {sorted(set(a) ^ set(b))}"
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    print(f"{len(a)} tensors bitwise equal")
    print("OK")


def windows(stream, first, count, context):
    n = (len(stream) - 1) // context
    rows = [stream[(g % n) * context:(g % n) * context + context + 1]
            for g in range(first, first + count)]
    return torch.tensor(np.stack(rows))


def mean_loss(model, x):
    logits = model(x[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             x[:, 1:].reshape(-1))


def train(hf_dir, out_dir, eval_json, data_glob, world, batch, context, steps, lr):
    model = GPT2LMHeadModel.from_pretrained(hf_dir).double()
    model.train()  # dropout is 0: train() only for parity of modes
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)  # PyTorch defaults, as the workers
    stream = read_stream(glob.glob(data_glob))
    per_step = world * batch
    k_terms = per_step * context
    for step in range(steps):
        # Global samples step * W * b ... : ranks r take b consecutive ones.
        x = windows(stream, step * per_step, per_step, context)
        optimizer.zero_grad()
        loss = mean_loss(model, x)
        loss.backward()
        optimizer.step()
        print(f"torch step {step + 1} loss {loss.item():.6f}")
    ours = load_checked(out_dir).double().state_dict()
    ref = model.state_dict()
    tol = 10 * gamma(k_terms)
    worst = 0.0
    for name, _ in model.named_parameters():
        d_ref = ref[name] - start[name]
        d_ours = ours[name] - start[name]
        if name.endswith("attn.c_attn.bias"):
            c = d_ref.shape[0] // 3
            key_ours = d_ours[c:2 * c]
            assert key_ours.abs().max().item() <= steps * lr * 1.01, f"{name}: key bias moved too far"
            d_ref = torch.cat([d_ref[:c], d_ref[2 * c:]])
            d_ours = torch.cat([d_ours[:c], d_ours[2 * c:]])
            name += " (query, value)"
        rel = ((d_ours - d_ref).norm() / d_ref.norm()).item()
        worst = max(worst, rel)
        print(f"{name:50s} change differs by {rel:.2e} (relative)")
        assert rel <= tol, f"{name}: the change differs by {rel:.3e} > {tol:.3e}"
    print(f"parameters within tolerance {tol:.2e} (worst {worst:.2e})")

    record = json.load(open(eval_json))
    model = load_checked(out_dir).double().eval()
    val = read_stream(record["val_data"])
    n, t = record["windows"], record["context"]
    x = torch.tensor(np.stack([val[k * t:k * t + t + 1] for k in range(n)]))
    with torch.no_grad():
        loss = sum(mean_loss(model, x[i:i + 4]).item() * len(x[i:i + 4])
                   for i in range(0, n, 4)) / n
    print(f"validation loss from_pretrained {loss:.8f}  worker {record['loss']:.8f}")
    assert abs(loss - record["loss"]) <= 3.2e-4, "validation losses differ"
    print("OK")


def main():
    command, args = sys.argv[1], sys.argv[2:]
    if command == "make":
        make(*args)
    elif command == "same":
        same(*args)
    elif command == "train":
        hf_dir, out_dir, eval_json, data_glob = args[:4]
        world, batch, context, steps = (int(a) for a in args[4:8])
        train(hf_dir, out_dir, eval_json, data_glob, world, batch, context, steps, float(args[8]))
    else:
        sys.exit(f"unknown command {command}")


if __name__ == "__main__":
    main()
