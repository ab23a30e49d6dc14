#!/usr/bin/env python3
"""Ratios of the device GPT (cuda_gpt_bench JSON) to PyTorch FSDP2
(torch_fsdp_gpt2.py JSON) from interleaved rounds on one GPU: per model,
dtype, attention kernel and ZeRO stage, the median tokens/s over the rounds,
PyTorch's eager median for the same model and dtype, their ratio, and both
peak device memories (ours: device bytes used above the start; PyTorch's:
the caching allocator's peak reserved). PyTorch runs with torch.compile
(torch_fsdp_gpt2.py --compile, "compiled": true) are not the ratio's
baseline: their median shows in a column of its own (COMPILED, "-" when
there is none). A second table puts stage 3 beside stage 0 (prefetch 1,
packed collectives) for each model, dtype and attention kernel: how far
stage 3 is behind, in percent of stage 0's tokens/s.

  python3 tests/gpu/compare_gpt.py ZS.json [ZS.json ...] -- TORCH.json [...] [--json_out=F]
"""
import json
import statistics
import sys


def load(paths):
    rows = []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        for r in doc.get("results", []):
            r["_device"] = doc.get("device", "?")
            rows.append(r)
    return rows


def main(argv):
    json_out = ""
    args = []
    for a in argv:
        if a.startswith("--json_out="):
            json_out = a.split("=", 1)[1]
        else:
            args.append(a)
    if "--" not in args:
        print(__doc__, file=sys.stderr)
        return 2
    cut = args.index("--")
    ours, theirs = load(args[:cut]), load(args[cut + 1:])
    torch_tps, torch_peak, compiled_tps = {}, {}, {}
    for r in theirs:
        key = (r["model"], r["dtype"])
        if r.get("compiled", False):
            compiled_tps.setdefault(key, []).append(r["tokens_per_second"])
            continue
        torch_tps.setdefault(key, []).append(r["tokens_per_second"])
        torch_peak.setdefault(key, []).append(r["device_peak_bytes"])
    groups = {}
    for r in ours:
        key = (r["model"], r["dtype"], r.get("attention", "?"), r["stage"], r.get("prefetch", 1),
               r.get("collectives", "packed"))
        groups.setdefault(key, []).append(r)
    out = []
    print(f"{'MODEL':10} {'DTYPE':5} {'ATTENTION':9} {'STAGE':7} {'TOKENS/s':>10} "
          f"{'TORCH':>10} {'RATIO':>6} {'PEAK GiB':>8} {'TORCH GiB':>9} {'COMPILED':>10} ROUNDS")
    for key in sorted(groups):
        model, dtype, attention, stage, prefetch, collectives = key
        # Stage 3 with a deeper prefetch than the default 1: "3 p2"; through
        # NCCL's block collectives: "3 blk".
        stage_label = f"{stage}" if prefetch == 1 else f"{stage} p{prefetch}"
        if collectives == "blocks":
            stage_label += " blk"
        tps = statistics.median(r["tokens_per_second"] for r in groups[key])
        peak = max(r["device_peak_bytes"] for r in groups[key])
        t = torch_tps.get((model, dtype))
        t_tps = statistics.median(t) if t else float("nan")
        t_peak = max(torch_peak[(model, dtype)]) if t else float("nan")
        ratio = tps / t_tps if t else float("nan")
        c = compiled_tps.get((model, dtype))
        c_tps = statistics.median(c) if c else None
        c_text = f"{c_tps:10.0f}" if c else f"{'-':>10}"
        print(f"{model:10} {dtype:5} {attention:9} {stage_label:7} {tps:10.0f} {t_tps:10.0f} "
              f"{ratio:6.2f} {peak / 2**30:8.2f} {t_peak / 2**30:9.2f} {c_text} {len(groups[key])}")
        out.append({"model": model, "dtype": dtype, "attention": attention, "stage": stage,
                    "prefetch": prefetch, "collectives": collectives,
                    "tokens_per_second": tps, "torch_tokens_per_second": t_tps,
                    "ratio": ratio, "device_peak_bytes": peak, "torch_peak_bytes": t_peak,
                    "torch_compiled_tokens_per_second": c_tps,
                    "rounds": len(groups[key])})
    # Stage 3 against stage 0 (both prefetch 1, packed collectives) per
    # model, dtype and attention kernel: what stage 3's gathers and
    # reductions cost at this W.
    versus = []
    for key in sorted(groups):
        model, dtype, attention, stage, prefetch, collectives = key
        if stage != 3 or prefetch != 1 or collectives != "packed":
            continue
        zero = groups.get((model, dtype, attention, 0, 1, "packed"))
        if not zero:
            continue
        tps0 = statistics.median(r["tokens_per_second"] for r in zero)
        tps3 = statistics.median(r["tokens_per_second"] for r in groups[key])
        versus.append({"model": model, "dtype": dtype, "attention": attention,
                       "stage0_tokens_per_second": tps0, "stage3_tokens_per_second": tps3,
                       "stage3_behind": 1 - tps3 / tps0})
    if versus:
        print()
        print(f"{'MODEL':10} {'DTYPE':5} {'ATTENTION':9} {'STAGE 0':>10} {'STAGE 3':>10} "
              f"{'3 BEHIND 0':>10}")
        for v in versus:
            print(f"{v['model']:10} {v['dtype']:5} {v['attention']:9} "
                  f"{v['stage0_tokens_per_second']:10.0f} {v['stage3_tokens_per_second']:10.0f} "
                  f"{100 * v['stage3_behind']:9.1f}%")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"device": ours[0]["_device"] if ours else "?", "rows": out,
                       "stage3_vs_stage0": versus}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
