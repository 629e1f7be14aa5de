"""benchmarks/: every script runs on the one harness (benchmarks/bench_utils.py) and answers --help, the
diagnostics run from their own folder, and the harness's result files record the command and the machine."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tiny_lm import tiny_model

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
# kept on their own helpers: the serving load test and the S-NIAH seed runner, owned with their subsystems
OWN_HELPERS = {"serve_load.py", "niah_seeds.py"}
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name != "bench_utils.py" and p.name not in OWN_HELPERS)
DIAGNOSTICS = sorted((BENCH / "diagnostics").glob("*.py"))

# what a script takes from the harness instead of writing it itself
OWN_CODE = {
    "peak RSS": r"ru_maxrss|getrusage|/proc/self",
    "timer": r"perf_counter|process_time|cuda\.Event",
    "JSON writer": r"json\.dump\(|write_text\(\s*json",
    "machine description": r"\bplatform\.|getloadavg|get_device_name|/proc/cpuinfo",
}

spec = importlib.util.spec_from_file_location("bench_utils", BENCH / "bench_utils.py")
harness = importlib.util.module_from_spec(spec)
spec.loader.exec_module(harness)


def _name(path: Path) -> str:
    return str(path.relative_to(BENCH))


def test_the_lists_are_not_empty():
    assert len(SCRIPTS) >= 15 and len(DIAGNOSTICS) >= 5
    assert not {p.name for p in SCRIPTS} & {p.name for p in DIAGNOSTICS}


@pytest.mark.parametrize("script", SCRIPTS, ids=_name)
def test_script_uses_the_harness(script):
    source = script.read_text()
    assert re.search(r"^from bench_utils import ", source, re.M), f"{script.name} does not import the harness"
    for what, pattern in OWN_CODE.items():
        found = re.search(pattern, source)
        assert found is None, f"{script.name} keeps its own {what} ({found.group(0)!r}): use bench_utils"


@pytest.mark.parametrize("script", DIAGNOSTICS, ids=_name)
def test_diagnostic_writes_through_the_harness(script):
    source = script.read_text()
    for what in ("peak RSS", "JSON writer", "machine description"):
        found = re.search(OWN_CODE[what], source)
        assert found is None, f"{script.name} keeps its own {what} ({found.group(0)!r}): use bench_utils"
    if "save_json" in source:
        assert "from bench_utils import" in source and "parents[1]" in source


# runs every script's --help in one interpreter (torch imported once), each as `python SCRIPT --help` would:
# its own folder first on sys.path, the harness not yet imported, run as __main__. Prints {script: "ok" or
# the failure}.
HELP_DRIVER = """
import contextlib, io, json, runpy, sys
out = {}
for script in sys.argv[1:]:
    sys.argv, buffer = [script, "--help"], io.StringIO()
    sys.modules.pop("bench_utils", None)  # each script finds the harness on its own path
    sys.path.insert(0, script.rsplit("/", 1)[0])
    try:
        with contextlib.redirect_stdout(buffer):
            runpy.run_path(script, run_name="__main__")
        out[script] = "no exit after --help"
    except SystemExit as e:
        ok = e.code in (0, None) and buffer.getvalue().startswith("usage:")
        out[script] = "ok" if ok else f"exit {e.code}: {buffer.getvalue()[-300:]}"
    except Exception as e:
        out[script] = f"{type(e).__name__}: {e}"
    sys.path.pop(0)
print(json.dumps(out))
"""


def test_help_runs_from_any_folder(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    scripts = [str(p) for p in SCRIPTS + DIAGNOSTICS]
    proc = subprocess.run(
        [sys.executable, "-c", HELP_DRIVER, *scripts],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = {Path(k).name: v for k, v in results.items() if v != "ok"}
    assert not failed and len(results) == len(scripts), failed


def test_writer_records_the_command_and_the_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(sys, "argv", ["benchmarks/x.py", "--reps", "3", "a b"])
    path = harness.save_json("x", {"rows": [{"tok_s": 1.0}]})
    assert path == tmp_path / "results" / "x.json"
    record = json.loads(path.read_text())
    assert record["command"] == "python benchmarks/x.py --reps 3 'a b'"
    machine = record["machine"]
    assert machine["cpu"] and machine["logical_cpus"] == os.cpu_count()
    assert machine["torch"] == torch.__version__ and machine["torch_threads"] == torch.get_num_threads()
    assert (machine["gpu"] is None) == (not torch.cuda.is_available())
    assert len(machine["loadavg_start"]) == len(machine["loadavg_end"]) == 3
    assert record["rows"] == [{"tok_s": 1.0}]
    # the machine described at the start is the one recorded; a path is written where it says
    start = {**harness.machine_info(), "cpu": "as at the start"}
    other = harness.save_json(tmp_path / "sub" / "y.json", {"machine": start, "n": 1})
    assert other == tmp_path / "sub" / "y.json"
    assert json.loads(other.read_text())["machine"]["cpu"] == "as at the start"
    assert harness.save_json(str(tmp_path / "z"), {}, machine=start) == tmp_path / "z"


def test_timing_and_resident_memory():
    assert harness.timing_summary([1.0, 3.0, 2.0]) == {
        "n": 3,
        "median_s": 2.0,
        "min_s": 1.0,
        "max_s": 3.0,
        "spread": 1.0,
    }
    calls = []
    times = harness.time_runs(lambda: calls.append(1), reps=3, warmup=2)
    assert len(calls) == 5 and len(times) == 3 and all(t >= 0 for t in times)
    with harness.Timer() as clock:
        time.sleep(0.05)
    assert clock.wall >= 0.05 and clock.cpu < 0.04
    block = bytearray(64 * 2**20)
    block[:: 2**12] = b"x" * len(range(0, len(block), 2**12))  # touch every page
    now = harness.current_rss_bytes()
    assert now > 64 * 2**20
    # the same unit as the current size (the kernel updates the peak in steps, so allow a little)
    assert harness.peak_rss_bytes() >= 0.95 * now
    assert harness.peak_rss_mib() == pytest.approx(harness.peak_rss_bytes() / 2**20, rel=0.01)


def test_worker_round_trip(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(
        f"import json, sys\nsys.path.insert(0, {str(BENCH)!r})\nfrom bench_utils import reply\n"
        "spec = json.loads(sys.argv[2])\nif spec['n'] < 0:\n    raise SystemExit('negative n')\n"
        "print('a line that is not the answer')\nreply({'twice': 2 * spec['n']})\n"
    )
    assert harness.run_worker(str(script), {"n": 21}) == {"twice": 42}
    failed = harness.run_worker(str(script), {"n": -1})
    assert failed["error"].startswith("exit 1") and "negative n" in failed["error"]


def test_niah_seeds_refuses_a_haystack_it_cannot_read_before_training(tmp_path):
    """An unknown (or not installed) evaluation haystack stops the runner at once, not after the training."""
    script = str(BENCH / "niah_seeds.py")
    cmd = [sys.executable, script, "--haystacks", "noise,the_web", "--out", str(tmp_path)]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown haystack 'the_web'" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "logs").exists()


def test_niah_seeds_stages_train_on_from_the_stage_before(tmp_path):
    """`niah_seeds.py --then FLAGS`: each stage trains from the model the stage before saved, the
    evaluations read the last stage's, and the summary keeps each stage's training check apart."""
    sys.path.insert(0, str(BENCH))
    try:
        import niah_seeds
    finally:
        sys.path.remove(str(BENCH))
    args = niah_seeds.argparse.Namespace(
        runs="R", out=str(tmp_path), threads=1, device="cpu", kind="passkey", recipe_extra="",
        train_eval_length=1024, time_budget=None, then=["--steps 3 --lr 3e-4", "--train-length 2048"],
        haystacks="noise,essays", lengths="1024", samples=1, eval_batch_size=2,
    )  # fmt: skip
    commands = niah_seeds.run_commands("mac", 4, args)
    assert [c[c.index("--save-model") + 1] for c in commands[:3]] == [
        "R/mac_s4",
        "R/mac_s4_stage2",
        "R/mac_s4_stage3",
    ]
    assert [c[c.index("--checkpoint") + 1] for c in commands[1:]] == ["R/mac_s4", "R/mac_s4_stage2"] + [
        "R/mac_s4_stage3"
    ] * 2
    assert "--lr" in commands[1] and "--train-length" not in commands[1] and "--train-recipe" in commands[2]
    runs = tmp_path / "runs"
    runs.mkdir()
    training = {"metadata": {"model": {"training": {"steps_done": 3, "seconds": 1.0}}}}
    for name in ("mac_s4_train", "mac_s4_stage2_train"):
        (runs / f"{name}.json").write_text(json.dumps(training))
    cells = [{"length": 1024, "correct": 1, "total": 2}]
    (runs / "mac_s4_noise.json").write_text(json.dumps({"cells": cells, "metadata": {"samples": [0, 1]}}))
    summary = niah_seeds.aggregate(tmp_path)
    assert set(summary["training"]) == {"mac_s4", "mac_s4_stage2"}
    assert summary["variants"] == {
        "mac": {"noise": {"1024": {"seeds": {"4": 0.5}, "mean": 0.5, "min": 0.5, "max": 0.5}}}
    }


def test_niah_seeds_aggregate_only_keeps_the_recipe_the_runs_were_trained_with(tmp_path, monkeypatch):
    """`niah_seeds.py --aggregate-only` re-reads the runs: the summary's recipe (and any hand-written
    evaluation command in it) stays, not replaced by the defaults of the options not given."""
    sys.path.insert(0, str(BENCH))
    try:
        import niah_seeds
    finally:
        sys.path.remove(str(BENCH))
    runs = tmp_path / "runs"
    runs.mkdir()
    cells = [{"length": 1024, "correct": 1, "total": 2}]
    (runs / "mac_s0_essays.json").write_text(json.dumps({"cells": cells, "metadata": {"samples": [0, 1]}}))
    recipe = {"kind": "number", "extra": "--steps 1500", "command": "titans eval niah --checkpoint X"}
    summary = tmp_path / "niah_seeds_k.json"
    summary.write_text(json.dumps({"variants": {}, "recipe": recipe}))
    argv = ["niah_seeds.py", "--aggregate-only", "--name", "k", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    niah_seeds.main()
    written = json.loads(summary.read_text())
    assert written["recipe"] == recipe and written["variants"]["mac"]["essays"]["1024"]["mean"] == 0.5
    summary.unlink()  # no summary yet: the options given are the recipe
    niah_seeds.main()
    assert json.loads(summary.read_text())["recipe"]["kind"] == "passkey"


def test_loss_by_position_without_its_data_says_to_run_make_data(tmp_path, monkeypatch):
    """Run before make_data.py, loss_by_position.py stops with one line naming the step, not a traceback."""
    spec = importlib.util.spec_from_file_location(
        "loss_by_position", BENCH / "lm_eval_tasks" / "loss_by_position.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "DATA", tmp_path / "prose_heldout.jsonl", raising=False)
    monkeypatch.setattr(sys, "argv", ["loss_by_position.py", str(tmp_path / "no_run")])
    with pytest.raises(SystemExit) as e:
        module.main()
    message = str(e.value.code)
    assert "make_data.py" in message and "\n" not in message


def test_loss_by_position_reports_bits_per_byte_of_a_subword_model_and_checks_its_options(
    tmp_path, monkeypatch, capsys
):
    """With a BPE model the script printed bits per token labelled "bits per byte" (8.96 where the bytes
    give 3.79); --doc out of range raised IndexError (-1 read the last document), --tokens 0 a torch error."""
    from micro_train import micro_config
    from titans.data.tokenizers import train_bpe
    from titans.training.trainer import Trainer

    spec = importlib.util.spec_from_file_location(
        "loss_by_position", BENCH / "lm_eval_tasks" / "loss_by_position.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = "the quick brown fox jumps over the lazy dog.\n"
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"text": text * k}) + "\n" for k in (5, 60)))
    monkeypatch.setattr(module, "DATA", data, raising=False)
    train_bpe([text * 50], 300, tmp_path / "bpe.json")
    corpus = tmp_path / "fox.txt"
    corpus.write_text(text * 500)
    run = tmp_path / "run"
    cfg = micro_config(
        run, tmp_path / "cache", steps=1, tokenizer=str(tmp_path / "bpe.json"), data=str(corpus)
    )
    Trainer(cfg).train(handle_signals=False)
    out = tmp_path / "lbp.json"
    monkeypatch.setattr(sys, "argv", ["lbp", str(run), "--tokens", "400", "--out", str(out)])
    module.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["from"], r["to"]) for r in rows] == [(0, 256), (256, 400)]
    for r in rows:  # several bytes a token: fewer bits a byte than a token
        assert 0 < r["bpb"] < r["bits_per_token"] / 2
    tokenizer = module.load_model(str(run))[2]
    targets = (module.separator_ids(tokenizer) + tokenizer.encode(text * 60))[1:401]  # one separator token
    total_bytes = sum(r["bits_per_token"] * (r["to"] - r["from"]) / r["bpb"] for r in rows)
    assert total_bytes == pytest.approx(len(tokenizer.decode(targets).encode()))
    for argv, want in (
        (["--doc", "2"], "--doc must be in [0, 1]"),
        (["--doc", "-1"], "--doc must be in"),
        (["--tokens", "0"], "--tokens must be >= 1"),
    ):
        monkeypatch.setattr(sys, "argv", ["lbp", str(run), *argv])
        with pytest.raises(SystemExit) as e:
            module.main()
        assert want in str(e.value.code)


def test_niah_seeds_keep_stages_trains_only_the_stages_without_a_good_checkpoint(tmp_path, monkeypatch):
    """`niah_seeds.py --keep-stages`: a stage whose folder holds a good checkpoint of a finished run is not
    trained again; a missing or damaged one, or one a signal stopped, is, and every later stage and
    evaluation still runs."""
    import torch

    from titans.runtime.checkpoint import save_checkpoint

    sys.path.insert(0, str(BENCH))
    try:
        import niah_seeds
    finally:
        sys.path.remove(str(BENCH))
    runs = tmp_path / "R"
    state = {"w": torch.ones(3)}
    finished = {"task_training": {"steps_done": 5, "final": {"step": 4, "loss": 0.1}}}
    for name in ("mac_s4", "mac_s4_stage2"):
        save_checkpoint(runs / name, 5, model_state=state, trainer_state={}, config=finished)
    damaged = save_checkpoint(runs / "mac_s4_stage2", 6, model_state=state, trainer_state={}, config={})
    (damaged / "model.safetensors").write_bytes(b"not a checkpoint")  # newest damaged, an older one good
    save_checkpoint(runs / "mac_s4_stage3", 1, model_state=state, trainer_state={}, config={})
    for path in (runs / "mac_s4_stage3").rglob("model.safetensors"):
        path.write_bytes(b"")  # its only checkpoint is damaged: trained again
    stopped = {"task_training": {"steps_done": 2, "final": {"step": 1, "stopped_by": "SIGTERM"}}}
    save_checkpoint(runs / "mac_s4_stage4", 2, model_state=state, trainer_state={}, config=stopped)
    args = niah_seeds.argparse.Namespace(
        runs=str(runs), out=str(tmp_path / "out"), threads=1, device="cpu", kind="passkey", recipe_extra="",
        train_eval_length=1024, time_budget=None, then=["--steps 3", "--steps 4", "--steps 5"],
        haystacks="noise", lengths="1024", samples=1, eval_batch_size=2, keep_stages=True,
    )  # fmt: skip
    ran = []
    monkeypatch.setattr(niah_seeds.subprocess, "call", lambda cmd, **kw: ran.append(cmd) or 0)
    niah_seeds.run_pipeline("mac", 4, args)
    saved = [c[c.index("--save-model") + 1] for c in ran if "--save-model" in c]
    assert saved == [str(runs / "mac_s4_stage3"), str(runs / "mac_s4_stage4")]  # stage 4 was stopped
    assert sum("--haystack" in c for c in ran) == 1
    log = (tmp_path / "out" / "logs" / "mac_s4.log").read_text()
    assert f"# kept {runs / 'mac_s4'}" in log and f"# kept {runs / 'mac_s4_stage2'}" in log
    args.keep_stages = False
    ran.clear()
    niah_seeds.run_pipeline("mac", 4, args)
    assert sum("--save-model" in c for c in ran) == 4  # without the flag every stage trains


def test_gpu_suite_trainer_part_is_a_valid_train_command():
    """`gpu_suite.py`'s trainer part runs `titans train` with `TRAINER_ARGS` on a GPU, where a typo would
    cost a device call: the arguments parse and make a valid `TrainConfig` here."""
    from titans.cli import build_parser
    from titans.training.cli import overrides_from_args
    from titans.training.config import TrainConfig

    sys.path.insert(0, str(BENCH))
    try:
        import gpu_suite
    finally:
        sys.path.remove(str(BENCH))
    args = build_parser().parse_args(["train", *gpu_suite.TRAINER_ARGS])
    cfg = TrainConfig(**overrides_from_args(args))
    assert (cfg.compile, cfg.cuda_graphs, cfg.device, cfg.log_every) == (True, True, "cuda", 1)
    assert "trainer" in gpu_suite.CAPS
    # what the trainer ran against what the benchmark timed, from two recorded H100 calls: 10x slower steps
    # (TF32 off in that trainer run; the benchmark turns it on)
    results = BENCH / "results"
    trainer = json.loads((results / "gpu_suite_h100_trainer.json").read_text())["parts"]
    bench = json.loads((results / "gpu_suite_h100_compile.json").read_text())["parts"]
    assert gpu_suite._trainer_vs_benchmark(trainer) is None  # no train2k row in that call
    ratio = gpu_suite._trainer_vs_benchmark({**trainer, "train2k": bench["train2k"]})
    assert ratio == pytest.approx(4560 / 46587, rel=0.01)


def test_gpu_suite_goals_skip_rows_whose_weights_are_not_finite():
    """`gpu_suite.py`'s goals take each model's fastest row, but not one whose weights came out not finite:
    a diverged run's speed is not training's."""
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_suite
    finally:
        sys.path.remove(str(BENCH))

    def row(variant, mode, tokens_per_s, finite=True):
        return {"seq": 2048, "variant": variant, "mode": mode, "tokens_per_s": tokens_per_s,
                "weights_finite": finite}  # fmt: skip

    rows = [row("transformer", "eager", 100.0), row("transformer", "compile", 1000.0, finite=False),
            row("mac", "eager", 70.0), row("mac", "compile", 90.0, finite=False)]  # fmt: skip
    goal = gpu_suite._goals({"train2k": {"rows": rows}})[0]
    assert (goal["variant"], goal["mode"], goal["transformer_mode"]) == ("mac", "eager", "eager")
    assert goal["ratio"] == pytest.approx(0.7) and goal["met"]
    lmm = gpu_suite._goals({"train2k": {"rows": [row("lmm", "eager", 5.0, finite=False)]}})[1]
    assert lmm["ratio"] is None and lmm["tokens_per_s"] is None and not lmm["met"]


def test_kernel_resources_counts_a_chunk_with_its_row_loops_as_often_as_they_run():
    """`kernel_resources.py` reads a kernel's machine code: instructions outside the chunk loop are not
    counted, the chunk loop's own once, and a row loop inside it once per row block. A listing in the
    shape `cuobjdump -sass` prints, with an outer loop (0x0020-0x0080) holding an inner one
    (0x0040-0x0060)."""
    sys.path.insert(0, str(BENCH))
    try:
        import kernel_resources
    finally:
        sys.path.remove(str(BENCH))
    sass = "\n".join(
        f"        /*{address:04x}*/                   {text} ;   /* 0x000 */"
        for address, text in [
            (0x00, "LDG.E R2, desc[UR4][R2.64]"),  # before the loops
            (0x10, "STL [R1+0x10], R2"),
            (0x20, "BAR.SYNC.DEFER_BLOCKING 0x0"),  # the chunk loop starts
            (0x30, "LDL R4, [R1+0x10]"),
            (0x40, "HMMA.1688.F32.TF32 R8, R12, R16, R8"),  # the row loop starts
            (0x50, "STL [R1+0x20], R8"),
            (0x60, "@P0 BRA 0x40"),  # the row loop's back edge
            (0x70, "STS [R3], R8"),
            (0x80, "@P1 BRA 0x20"),  # the chunk loop's back edge
            (0x90, "EXIT"),
        ]
    )
    instructions = kernel_resources.parse_sass(sass)
    assert len(instructions) == 10 and instructions[6] == (0x60, "@P0 BRA 0x40")
    counts = kernel_resources.per_chunk(instructions, inner_trips=4)
    # chunk loop: 0x20, 0x30, 0x70, 0x80 once; 0x40, 0x50, 0x60 four times
    assert counts == {
        "instructions": 4 + 3 * 4,
        "spill": 1 + 4,
        "barrier": 1,
        "mma": 4,
        "shared": 1,
        "global": 0,
        "row_loops": 1,
    }
    assert kernel_resources.per_chunk(instructions[:2], inner_trips=4) == {}  # no loop


@pytest.mark.slow  # the presets' kernels compiled for two GPUs by Triton's own compiler: ~1.5 min of a core
@pytest.mark.parametrize("capability", [90, 80])
def test_kernel_resources_reads_the_presets_kernels_as_compiled_for_a_gpu(tmp_path, capability):
    """`kernel_resources.py` on the presets' depth-2 memory with TF32, as `titans train` runs it on an H100
    / H200 (9.0) or an A100 (8.0): both kernels compile without a GPU, each finds its chunk loop (the
    backward its row loop inside it), fits the shared memory a block may use there (227 KB, 163 KB), runs
    its products on tensor cores, keeps more than 32 registers a thread and spills under a third of its
    instructions. Built at ptxas's -O3, the A100's kernels keep 32 registers and spill half of theirs
    (`triton_chunk.ptxas_options`)."""
    out = tmp_path / "resources.json"
    script = BENCH / "kernel_resources.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("TITANS_MEMORY_TRITON_PTXAS", None)
    cmd = [sys.executable, str(script), "--cases", "2:128", "--capability", str(capability)]
    cmd += ["--out", str(out)]
    run = subprocess.run(cmd, cwd=BENCH, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["kernel"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"forward", "backward"}
    assert rows["backward"]["per_chunk"]["row_loops"] >= 1 and rows["forward"]["per_chunk"]["row_loops"] == 0
    for name, row in rows.items():
        chunk = row["per_chunk"]
        assert row["shared_bytes"] <= {90: 232_448, 80: 166_912}[capability], (name, row)
        assert chunk["mma"] > 0 and row["registers"] > 32, (name, row)
        assert chunk["spill"] < chunk["instructions"] / 3, (name, chunk)


def test_activation_memory_counts_what_each_option_saves(tmp_path):
    """`activation_memory.py` on a tiny MAC: the memory's checkpointing keeps fewer bytes than every state
    kept, gradient checkpointing's peak (one of the two blocks recomputed) is below the plain forward's,
    and every byte is attributed to a module and a block (or to what runs outside the blocks)."""
    out = tmp_path / "am.json"
    cmd = [sys.executable, str(BENCH / "activation_memory.py"), "--preset", "tiny", "--variants", "mac"]
    cmd += ["--seq", "96", "--memory-checkpoint-every", "0,3", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=BENCH)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain, checkpointed = json.loads(out.read_text())["rows"]
    assert checkpointed["memory_checkpoint_every"] == 3
    assert checkpointed["by_module"]["NeuralMemory"] < plain["by_module"]["NeuralMemory"]
    for row in (plain, checkpointed):
        assert sum(row["by_module"].values()) == sum(row["by_block"].values()) == row["saved_bytes"]
        assert set(row["by_block"]) == {"0", "1", "outside"}
        blocks = [row["by_block"][b] for b in ("0", "1")]
        assert max(blocks) + row["by_block"]["outside"] < row["recomputed_peak_bytes"] < row["saved_bytes"]


def test_activation_memory_counts_rms_norm_as_the_fused_kernel_saves():
    """On CPU F.rms_norm is a composition that keeps three float32 copies of its input; `activation_memory.py`
    counts what CUDA's fused kernel keeps instead (the input, the weight, a float32 rstd per row), with
    F.rms_norm's outputs and gradients."""
    code = """
import json, torch, torch.nn.functional as F
import activation_memory as am
torch.manual_seed(0)
x = torch.randn(3, 5, 48, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(48, dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(3, 5, 48, dtype=torch.bfloat16)
saved = {}
def pack(t):
    saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return t
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    y = am.fused_rms_norm(x, (48,), w, 1e-6)
want = F.rms_norm(x, (48,), w, 1e-6)
grads = [torch.autograd.grad(out, (x, w), g) for out in (y, want)]
print(json.dumps({"saved": sum(saved.values()), "y": (y.float() - want.float()).abs().max().item(),
    "g": max((a.float() - b.float()).abs().max().item() for a, b in zip(*grads))}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=99, cwd=BENCH)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["saved"] == (15 * 48 + 48) * 2 + 15 * 4  # x and w in bf16, rstd in float32
    assert got["y"] < 0.05 and got["g"] < 0.25  # bf16 rounding, F.rms_norm's values


def _tensors(state) -> list[torch.Tensor]:
    """The tensors of a state tree, in its order."""
    found = []
    state.map(lambda t: found.append(t) or t)
    return found


@pytest.mark.parametrize(
    "options", [{}, {"mac_gate": "open", "mac_norm_memory_tokens": True, "attn_output_gate": True}]
)
def test_mac_segment_loop_per_segment_form_equals_the_block(options):
    """`mac_segment_loop.py` times `MACBlock.mix` (what depends on x alone computed once for all segments)
    against `mix_per_segment` (the paper's loop, everything per segment): they compute the same thing,
    from a fresh state and from one in mid-segment, outputs and states to the bit in float64 and
    gradients to rounding."""
    sys.path.insert(0, str(BENCH))
    try:
        from mac_segment_loop import mix_per_segment
    finally:
        sys.path.remove(str(BENCH))
    block = tiny_model("mac", seed=6, dim=32, **options).blocks[0]
    params = list(block.parameters())
    x = torch.randn(2, 29, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x.requires_grad_(True)
    mid = block.mix(x[:, :5].detach(), None, None)[1].detach()  # 5: inside the first segment (8), chunk (4)
    for state in (None, mid):
        (got, got_state), (want, want_state) = block.mix(x, state, []), mix_per_segment(block, x, state, [])
        assert torch.equal(got, want)
        got_tensors, want_tensors = _tensors(got_state), _tensors(want_state)
        assert len(got_tensors) == len(want_tensors) > 0
        assert all(torch.equal(a, b) for a, b in zip(got_tensors, want_tensors))
        g = torch.randn_like(got)
        grads = torch.autograd.grad(got, [x, *params], g, allow_unused=True)
        for a, b in zip(grads, torch.autograd.grad(want, [x, *params], g, allow_unused=True)):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_fused_chunk_step_benchmark_times_both_steps(monkeypatch):
    """`fused_chunk_step.py` at a small shape: the fused step runs only when switched on, both give the
    same logits to float32 rounding, and the step alone is timed on both."""
    from titans.ops import cpu_kernels

    kernel = cpu_kernels.kernels()
    if kernel is None:
        pytest.skip("the CPU kernels could not be built here")
    sys.path.insert(0, str(BENCH))
    try:
        import fused_chunk_step
    finally:
        sys.path.remove(str(BENCH))
    calls = []

    class Recording:
        def __getattr__(self, name):
            return getattr(kernel, name)

        def chunk_step_forward(self, *args):
            calls.append(1)
            return kernel.chunk_step_forward(*args)

    monkeypatch.setattr(fused_chunk_step.memory_chunk, "kernels", lambda: Recording())
    model = tiny_model("lmm", seed=1)
    tokens = torch.randint(0, model.config.vocab_size, (1, 40))
    with fused_chunk_step.step(False):
        fused_chunk_step.prefill(model, tokens)
    assert not calls
    fused_chunk_step.prefill(model, tokens)
    assert calls
    row = fused_chunk_step.measure("lmm", "tiny", 2, 40, 1, 1)
    assert row["logits_max_abs_diff"] < 1e-4
    assert row["torch_step_us"] > 0 and row["fused_step_us"] > 0 and row["speedup"] > 0


def test_a_finished_run_is_reused_only_for_the_settings_it_was_trained_with(tmp_path):
    """paper_options.py and main_budget_seeds.py read a run folder's report when it had one, whatever it
    was trained with: a second call with another --steps, --seed or --set recorded the first call's numbers
    under its own settings. `finished_run` reuses a run only if its config is the one asked for."""
    from titans.training.config import TrainConfig

    run = tmp_path / "mac"
    args = ["--config", str(ROOT / "configs/compare_mac.json"), "--variant", "mac", "--steps", "2"]
    args += [
        "--seed",
        "0",
        "--run-dir",
        str(run),
        "--set",
        "threads=1",
        "--set",
        "model.attn_output_gate=true",
    ]
    assert not harness.finished_run(run, args)
    cfg = TrainConfig.from_file(ROOT / "configs/compare_mac.json", {"variant": "mac", "steps": 2, "seed": 0})
    cfg.run_dir, cfg.threads, cfg.model = str(run), 1, {**cfg.model, "attn_output_gate": True}
    run.mkdir()
    cfg.save(run / "config.json")
    (run / "report.json").write_text("{}")
    assert harness.finished_run(run, args)
    for changed in (["--seed", "1"], ["--steps", "3"], ["--set", "lr=0.5"]):
        with pytest.raises(SystemExit, match="holds a finished run with other settings"):
            harness.finished_run(run, [*args, *changed])
    # a run a signal stopped wrote its report at the step it reached: not finished (it is trained again;
    # its numbers were read as the run's after a Ctrl-C and a rerun)
    (run / "report.json").write_text('{"step": 1, "stopped_by": "SIGINT"}')
    assert not harness.finished_run(run, args)


def test_save_json_replaces_a_result_whole_or_not_at_all(tmp_path, monkeypatch):
    """A benchmark's result file was written in place: a full disk left truncated JSON where a good result
    had been. It is written to a temporary file and renamed."""
    path = tmp_path / "r.json"
    monkeypatch.setattr(harness, "result_path", lambda target: path)
    harness.save_json("r", {"machine": {"cpu": "x"}, "first": 1})
    good = path.read_text()

    def full_disk(fd):  # the disk filled while the new file was written
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full_disk)
        with pytest.raises(OSError):
            harness.save_json("r", {"machine": {"cpu": "x"}, "second": list(range(10_000))})
    assert path.read_text() == good and json.loads(good)["first"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sections", "sped"], "unknown section 'sped'"),  # wrote a JSON with no results, exit 0
        (["--sections", "speed", "--rules", "titan"], "unknown rule 'titan'"),  # a bare KeyError
        (["--sections", "speed", "--tokns", "9"], "--tokns 9: options of the lm section"),  # dropped silently
    ],
)
def test_memory_rules_refuses_unknown_sections_rules_and_options(argv, message, tmp_path):
    cmd = [sys.executable, str(BENCH / "memory_rules.py"), *argv, "--name", str(tmp_path / "r.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=BENCH)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "r.json").exists()


def test_grad_vs_length_takes_a_string_field_in_set(tmp_path):
    """`--set memory_forget_to=init` failed in ast.literal_eval: each --set is read as its field's type."""
    out = tmp_path / "g.json"
    cmd = [sys.executable, str(BENCH / "diagnostics" / "grad_vs_length.py"), "--preset", "tiny"]
    cmd += ["--variant", "lmm", "--lengths", "8", "--set", "memory_forget_to=init", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=BENCH)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "memory_forget_to=init" in proc.stdout


@pytest.mark.parametrize(
    "script, argv, message",
    [
        # seed 0 counted twice in the means, sd and paired t; its run folder trained twice, maybe at once
        ("main_budget_seeds.py", ["--seeds", "0,0,1"], "expected distinct seeds"),
        ("main_budget_seeds.py", ["--seeds", "0", "--variants", "mac,mac"], "--variants has duplicates"),
        # two pipelines into one checkpoint folder and one log at once
        ("niah_seeds.py", ["--seeds", "0,0"], "expected distinct seeds"),
        ("niah_seeds.py", ["--seeds", "0", "--variants", "lmm,lmm"], "--variants has duplicates"),
    ],
)
def test_seed_studies_refuse_a_repeated_seed_or_variant_before_training(script, argv, message, tmp_path):
    cmd = [sys.executable, str(BENCH / script), *argv]
    cmd += ["--out-dir" if script == "main_budget_seeds.py" else "--runs", str(tmp_path / "runs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=BENCH)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "runs").exists()


def test_context_seeds_refuses_one_checkpoint_given_as_two_seeds(tmp_path):
    """A file given twice counted as two seeds in the means and ranges."""
    files = [str(ROOT / "results" / "long_context" / f"lmm_init_s{s}_8k.json") for s in (0, 0, 2)]
    proc = subprocess.run(
        [sys.executable, str(BENCH / "context_seeds.py"), *files], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "one file per seed" in proc.stderr, proc.stderr[-2000:]
    ok = subprocess.run(
        [
            sys.executable,
            str(BENCH / "context_seeds.py"),
            *(f.replace("s0_8k", "s1_8k", 1) for f in files[1:2]),
            files[0],
            files[2],
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0 and "3 files" in ok.stdout, ok.stderr[-2000:]
