"""The compiled static decoder (`titans.models.decode_graph.StaticDecoder`, mode "compile") under several
compile settings, side by side in one process: each setting's decoder decodes whole chunk/segment cycles
in turn (one burst each, round after round), so a change of load hits them all alike.

A model (random weights, float32, `--preset`, `--variant`) reads a `--context` of random tokens; every
setting starts from that state. Before timing, each decoder is checked against the eager static step
(`mode="eager"`) on the same tokens over `--check-cycles` cycles (logits and every state tensor after).
Reported per setting: the median over bursts of the burst's median ms per token, the best burst, the
compile time (every phase's step, first use) and the largest differences from the eager step.

Settings (`--settings`, comma separated):
    blas        mm="blas": the one-token matmuls (matrix-vector products) left to BLAS calls
    pointwise   StaticDecoder's default, mm="pointwise": inductor writes them into its generated code
    blas_state  mm="blas", guards="state": torch.compile checks only the tensors, torch's global state and
                the decoder's own objects before each call, not the model's modules
    state       guards="state" (and pointwise matmuls)

    python benchmarks/decode_graph_options.py [--settings blas,pointwise,blas_state,state] [--threads 1]
        [--rounds 8] [--json decode_graph_options_tiny_mac_cpu_1thread]
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch

from bench_utils import Timer, save_json, timing_summary
from decode_graph import decode_setup

SETTINGS = {
    "blas": {"mm": "blas"},
    "pointwise": {},
    "blas_state": {"mm": "blas", "guards": "state"},
    "state": {"guards": "state"},
    "cpp_gemm": {
        "mm": "blas",
        "compile_options": {"max_autotune": True, "max_autotune_gemm_backends": "CPP"},
    },
}


def _state_diff(a, b) -> float:
    from titans.models.state import state_tensors

    ta, tb = state_tensors(a), state_tensors(b)
    assert ta.keys() == tb.keys(), "the states hold different tensors"
    return max((ta[k].float() - tb[k].float()).abs().max().item() for k in ta if ta[k].numel())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="mac")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--settings", default="blas,pointwise,blas_state,state")
    p.add_argument("--rounds", type=int, default=8, help="timed bursts per setting (one cycle each)")
    p.add_argument("--check-cycles", type=int, default=2)
    p.add_argument("--json", default=None, help="write the results here (a path, or a name in results/)")
    args = p.parse_args()
    machine, model, cycle = decode_setup(args.preset, args.variant, args.threads)
    cfg = model.config
    from titans.models.decode_graph import StaticDecoder

    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; known: {sorted(SETTINGS)}")
    with torch.no_grad():
        out, state = model(torch.randint(0, cfg.vocab_size, (1, args.context)), last_only=True)
        n_check = args.check_cycles * cycle
        tokens = torch.randint(0, cfg.vocab_size, (n_check, 1, 1))
        ref = StaticDecoder(model, state, mode="eager")
        ref_logits = torch.stack([ref.step(t) for t in tokens])
        ref_state = ref.state()
        rows, decoders = {}, {}
        for name in names:
            with Timer() as clock:  # the first cycle compiles every phase
                dec = StaticDecoder(model, state, mode="compile", **SETTINGS[name])
                logits = torch.stack([dec.step(t) for t in tokens])
            rows[name] = {
                "setting": name,
                "options": repr(SETTINGS[name]),
                "compile_and_check_s": round(clock.wall, 1),
                "max_logit_diff_vs_eager_static": (logits - ref_logits).abs().max().item(),
                "max_state_diff_vs_eager_static": _state_diff(dec.state(), ref_state),
            }
            print(f"{name}: compiled and checked in {rows[name]['compile_and_check_s']} s", flush=True)
            dec.load(state)
            decoders[name] = dec
        times = {n: [] for n in names}
        token = out[:, -1].argmax(-1, keepdim=True)
        for _ in range(args.rounds):
            for name in names:
                step, burst = partial(decoders[name].step, check_ids=False), []  # as generate steps
                for _ in range(cycle):
                    with Timer() as clock:
                        token = step(token).argmax(-1, keepdim=True)
                    burst.append(clock.wall)
                times[name].append(burst)
    print(f"{args.variant} {args.preset}, {args.threads} thread(s), context {args.context}, "
          f"{args.rounds} bursts of {cycle} tokens per setting, taking turns")  # fmt: skip
    print(
        f"{'setting':<10}{'ms/token':>10}{'best burst':>12}{'compile s':>11}{'d logits':>10}{'d state':>10}"
    )
    base = None
    for name in names:
        medians = [statistics.median(b) for b in times[name]]
        r = rows[name]
        r["ms_per_token"] = 1000 * statistics.median(medians)
        r["ms_best_burst"] = 1000 * min(medians)
        r["burst_medians_ms"] = [round(1000 * m, 4) for m in medians]
        r["timing"] = timing_summary([t for b in times[name] for t in b])
        base = base or r["ms_per_token"]
        r["speedup_vs_first"] = base / r["ms_per_token"]
        d_logits, d_state = r["max_logit_diff_vs_eager_static"], r["max_state_diff_vs_eager_static"]
        print(f"{name:<12}{r['ms_per_token']:>10.3f}{r['ms_best_burst']:>12.3f}{r['compile_and_check_s']:>11.1f}"
              f"{d_logits:>10.1e}{d_state:>10.1e}")  # fmt: skip
    if args.json:
        result = {"benchmark": "decode_graph_options", "args": vars(args), "rows": list(rows.values())}
        print(f"wrote {save_json(args.json, result, machine)}")


if __name__ == "__main__":
    main()
