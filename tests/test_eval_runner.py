"""The long-context evaluation runner, the fine-tuning recipe and the `titans eval` commands."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

import titans.evaluation.cli as eval_cli
import titans.evaluation.recipe as recipe_module
from titans.data.tokenizers import ByteTokenizer
from titans.evaluation.babilong import babilong_grid
from titans.evaluation.niah import niah_grid
from titans.evaluation.runner import evaluate, greedy_generate, predict, prefill
from titans.evaluation.task_training import (
    HoldThenCosine,
    LengthCurriculum,
    TaskTrainConfig,
    collate,
    masked_loss,
    min_task_length,
    task_example,
    train_on_task,
)
from titans.models import TitansConfig, TitansLM
from titans.runtime.loading import load_checkpoint_from

TOK = ByteTokenizer()
VOCAB = 256


class OracleModel:
    """Streaming stub whose greedy continuation of a known prompt is that prompt's answer.

    State: every token seen so far (per row). While the history is still inside a prompt the logits are
    flat; once a whole prompt has been read, the last position's logits point at the next answer token.
    """

    def __init__(self, samples):
        self.answers = {tuple(s.prompt_ids): list(s.answer_ids) for s in samples}
        self.prompt_lengths = sorted({len(p) for p in self.answers}, reverse=True)
        self.calls = 0

    def __call__(self, tokens, state=None, last_only=False):
        self.calls += 1
        history = [[] for _ in range(tokens.shape[0])] if state is None else state
        history = [h + row for h, row in zip(history, tokens.tolist())]
        logits = torch.zeros(tokens.shape[0], tokens.shape[1], VOCAB)
        for b, h in enumerate(history):
            for n in self.prompt_lengths:
                answer = self.answers.get(tuple(h[:n]))
                if answer is not None and 0 <= len(h) - n < len(answer):
                    logits[b, -1, answer[len(h) - n]] = 1.0
                    break
        return (logits[:, -1:] if last_only else logits), history


class ConstantGuessModel:
    """Streaming stub that always answers ``guess``: after the prompt's last "Answer:" it spells it out."""

    def __init__(self, guess: str, marker: str = "Answer:"):
        self.guess, self.marker = guess, marker

    def __call__(self, tokens, state=None, last_only=False):
        history = [""] * tokens.shape[0] if state is None else state
        history = [h + TOK.decode(row) for h, row in zip(history, tokens.tolist())]
        logits = torch.zeros(tokens.shape[0], tokens.shape[1], VOCAB)
        for b, h in enumerate(history):
            said = h.rsplit(self.marker, 1)[-1] if self.marker in h else ""
            nxt = self.guess[len(said)] if len(said) < len(self.guess) else "."
            logits[b, -1, ord(nxt)] = 1.0
        return (logits[:, -1:] if last_only else logits), history


def tiny_config(variant: str, **kw) -> TitansConfig:
    base = dict(dim=32, depth=2, heads=2, segment_len=16, window=16, chunk_size=4, persistent_tokens=2)
    return TitansConfig.preset("tiny", variant=variant, **{**base, **kw})


# ------------------------------------------------------------------------------------------------ runner


def test_oracle_scores_100_percent_with_chunked_prefill():
    niah = niah_grid(TOK, [300, 357], [0.0, 0.5, 1.0], samples_per_cell=2)
    babi = babilong_grid(
        TOK, [480], ["qa1", "qa2"], samples_per_cell=3, num_facts=3
    )  # answers of several lengths
    samples = niah + babi
    oracle = OracleModel(samples)
    predictions = predict(oracle, TOK, samples, batch_size=4, prefill_chunk=37)
    assert predictions == [s.answer if s.answer.startswith(" ") else " " + s.answer for s in samples]
    result = evaluate(oracle, TOK, niah, by="depth", batch_size=3, prefill_chunk=64)
    assert result.table.overall == 1.0 and all(result.correct)
    assert result.table.rows == [300, 357] and result.table.cols == [0.0, 0.5, 1.0]
    assert sum(t for _, t in result.table.counts.values()) == len(niah)


def test_constant_guess_scores_its_base_rate():
    samples = babilong_grid(TOK, [400], ["qa1"], samples_per_cell=60, num_facts=2)
    result = evaluate(
        ConstantGuessModel(" kitchen"), TOK, samples, by="task", batch_size=16, prefill_chunk=128
    )
    base_rate = sum(s.answer == "kitchen" for s in samples) / len(samples)
    assert result.table.overall == pytest.approx(base_rate)
    assert 0.03 < base_rate < 0.4  # one of six rooms: near chance, far from 0 and 1
    passkeys = niah_grid(TOK, [300], [0.0, 1.0], samples_per_cell=5)
    guess = ConstantGuessModel(" 12345", marker="The pass key is")
    assert evaluate(guess, TOK, passkeys, batch_size=4).table.overall == 0.0


@pytest.mark.parametrize("variant", ["mac", "lmm", "swa"])
def test_chunked_prefill_matches_one_pass(variant):
    torch.manual_seed(0)
    model = TitansLM(tiny_config(variant)).eval()
    prompt = torch.randint(0, VOCAB, (2, 37))  # not a multiple of chunk, segment or prefill piece
    last_one, _ = prefill(model, prompt, prefill_chunk=37)
    last_chunked, _ = prefill(model, prompt, prefill_chunk=7)
    torch.testing.assert_close(last_chunked, last_one, atol=1e-4, rtol=1e-4)
    whole, _ = model(prompt)
    torch.testing.assert_close(last_one, whole[:, -1], atol=1e-4, rtol=1e-4)
    a = greedy_generate(model, prompt, 4, prefill_chunk=37)
    b = greedy_generate(model, prompt, 4, prefill_chunk=5)
    assert torch.equal(a, b)
    # greedy decoding through the state equals re-reading the grown prompt each time
    grown = prompt
    for _ in range(4):
        logits, _ = model(grown)
        grown = torch.cat([grown, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(a, grown[:, 37:])


def test_runner_rejects_bad_input():
    model = OracleModel([])
    with pytest.raises(ValueError, match="prefill_chunk"):
        prefill(model, torch.zeros(1, 4, dtype=torch.long), prefill_chunk=0)
    with pytest.raises(ValueError, match="no samples"):
        evaluate(model, TOK, [])
    with pytest.raises(ValueError, match="match rule"):
        evaluate(model, TOK, niah_grid(TOK, [300], [0.5]), match="fuzzy")


# ------------------------------------------------------------------------------------------------ recipe


def test_training_batches_mask_only_the_answer():
    cfg = TaskTrainConfig(task="babilong", babi_tasks=("qa1", "qa2"), num_facts=3)
    examples = [task_example(TOK, cfg, length=420, seed=s) for s in range(4)]
    inputs, targets, mask = collate(examples)
    assert inputs.shape == targets.shape == mask.shape == (4, 419)
    for row, e in enumerate(examples):
        answer = [t for t, m in zip(e.tokens, e.loss_mask) if m]
        assert targets[row][mask[row]].tolist() == answer
    with pytest.raises(ValueError, match="share a length"):
        collate(examples[:1] + [task_example(TOK, cfg, length=436, seed=9)])
    assert 272 <= min_task_length(TOK, TaskTrainConfig()) <= 320  # the pass-key prompt is ~270 bytes


def test_training_mixes_several_haystacks_evenly_and_refuses_unknown_ones():
    """`--train-haystack noise,sotu`: consecutive training examples take the haystacks in turn (a batch of
    the pass key holds both), each example built exactly as with that haystack alone."""
    from titans.cli import build_parser
    from titans.evaluation.haystack import NOISE_TEXT
    from titans.evaluation.recipe import task_config

    args = build_parser().parse_args(["eval", "niah", "--train-recipe", "--train-haystack", "noise,sotu"])
    mixed = task_config(args, "niah", kind="passkey", haystack=None)
    assert mixed.haystack == ("noise", "sotu")
    for seed in range(11, 17):  # odd and even seeds, 600 tokens
        alone = "noise" if seed % 2 == 0 else "sotu"
        example = task_example(TOK, mixed, length=600, seed=seed)
        assert example == task_example(TOK, replace(mixed, haystack=alone), length=600, seed=seed)
        assert (NOISE_TEXT.split(". ")[1] in TOK.decode(example.tokens)) == (alone == "noise")
    babi = TaskTrainConfig(task="babilong", babi_tasks=("qa1", "qa2"), haystack=("moby_dick", "sotu"))
    picked = {babi.babilong_for(s) for s in range(4)}
    assert len(picked) == 4  # every task on every haystack
    assert replace(mixed, haystack="essays").haystack_for(5) == "essays"
    with pytest.raises(ValueError, match="haystack"):
        TaskTrainConfig(haystack=("noise", "the_web"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "niah", "--train-haystack", "noise,the_web"])


def test_training_with_decoy_numbers():
    """`--train-distractors 2`: every pass-key training prompt holds decoy numbers; refused for BABILong and
    below zero."""
    from titans.cli import build_parser
    from titans.evaluation.recipe import task_config

    args = build_parser().parse_args(["eval", "niah", "--train-recipe", "--train-distractors", "2"])
    cfg = task_config(args, "niah", kind="passkey", haystack=None)
    assert cfg.distractors == 2.0
    plain = task_example(TOK, replace(cfg, distractors=0.0), length=2000, seed=3)
    example = task_example(TOK, cfg, length=2000, seed=3)
    assert len(example.tokens) == 2000 and example.tokens[-6:] == plain.tokens[-6:]  # the same answer
    assert (
        len(re.findall(r"\d+", TOK.decode(example.tokens)))
        >= len(re.findall(r"\d+", TOK.decode(plain.tokens))) + 3
    )
    with pytest.raises(ValueError, match="distractors"):
        TaskTrainConfig(distractors=-1.0)
    with pytest.raises(ValueError, match="task='niah' only"):
        TaskTrainConfig(task="babilong", distractors=1.0)


def test_curriculum_lengths_ramp_and_stay_in_bounds():
    cur = LengthCurriculum(min_length=272, start_length=300, max_length=1024, ramp_steps=100, multiple=16)
    lengths = [cur.length(s) for s in range(200)]
    assert all(272 <= n <= 1024 for n in lengths)
    assert all(n <= cur.cap(s) for s, n in enumerate(lengths)) and max(lengths[150:]) > 700
    assert all(n % 16 == 0 for n in lengths)
    assert cur.cap(0) == 300 and cur.cap(100) == 1024
    adaptive = LengthCurriculum(272, 288, 1024, ramp_steps=0, loss_threshold=1.0, patience=5)
    adaptive.update(5, 1.5)
    assert adaptive.cap(5) == 288  # loss too high: no growth
    adaptive.update(6, 0.5)
    assert adaptive.cap(6) == 360  # x1.25
    adaptive.update(8, 0.5)
    assert adaptive.cap(8) == 360  # patience
    for step in range(10, 200, 5):
        adaptive.update(step, 0.5)
    assert adaptive.cap(200) == 1024


def test_hold_lr_keeps_the_peak_until_the_curriculum_is_full_then_decays_to_the_floor():
    hold = HoldThenCosine(warmup_steps=4, total_steps=30, min_lr_ratio=0.1)
    assert [hold(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert all(hold(s) == 1.0 for s in range(4, 30))  # never released: the whole run at the peak
    hold.release(11)
    hold.release(20)  # once only
    assert hold.released_at == 12 and hold(12) == 1.0
    factors = [hold(s) for s in range(12, 31)]
    assert all(a > b for a, b in zip(factors, factors[1:-1]))  # strictly decreasing to the end
    assert factors[-1] == pytest.approx(0.1) and hold(40) == pytest.approx(0.1)
    early = HoldThenCosine(10, 30, 0.1)
    early.release(2)  # in the warm-up: the decay starts after it
    assert early.released_at == 10 and early(9) == early(10) == 1.0 > early(11)

    # In training: the adaptive curriculum (threshold above any loss) grows the cap 288 -> 304 -> 320 at
    # steps 0 and 10; the peak lr holds until then and the cosine spans the steps after it.
    torch.manual_seed(0)
    model = TitansLM(tiny_config("lmm", depth=1))
    cfg = TaskTrainConfig(
        train_length=320,
        start_length=288,
        curriculum_loss=100.0,
        steps=24,
        batch_size=2,
        lr=1e-3,
        warmup_steps=2,
        log_every=1,
        hold_lr=True,
    )
    history = train_on_task(model, TOK, cfg, log=None)
    caps = [h["max_length"] for h in history]
    full = caps.index(320)
    assert 0 < full < 20
    lrs = [h["lr"] for h in history]  # the lr each step used (the next step's was logged)
    assert lrs[0] == pytest.approx(0.5e-3)  # warm-up: step 0 of 2
    assert all(lr == pytest.approx(1e-3) for lr in lrs[1 : full + 2])
    assert history[-1]["lr_released_at"] == full + 1 and 1e-4 < lrs[-1] < 1.2e-4  # the last step's
    plain = train_on_task(TitansLM(tiny_config("lmm", depth=1)), TOK, replace(cfg, hold_lr=False), log=None)
    assert plain[full + 1]["lr"] < 1e-3 and "lr_released_at" not in plain[-1]


def test_recipe_lowers_the_answer_loss_and_gates_are_set():
    torch.manual_seed(0)
    model = TitansLM(tiny_config("lmm", depth=1, memory_alpha_init=1e-3, memory_eta_init=0.5))
    bias = model.blocks[0].memory.to_gates.bias.detach()
    assert torch.sigmoid(bias[-1]).item() == pytest.approx(1e-3, rel=1e-4)
    cfg = TaskTrainConfig(
        train_length=304, start_length=288, steps=8, batch_size=4, lr=3e-2, warmup_steps=2, log_every=1
    )
    batch = collate([task_example(TOK, cfg, length=304, seed=10**6 + s) for s in range(4)])
    before = masked_loss(model, *batch)[0].item()
    history = train_on_task(model, TOK, cfg, log=None)
    after = masked_loss(model, *batch)[0].item()
    assert len(history) == 8 and after < before - 2.0  # learns at least the answer's format (5.5 -> 2.4)
    with pytest.raises(ValueError, match="train_length"):
        train_on_task(model, TOK, TaskTrainConfig(train_length=100), log=None)


# ------------------------------------------------------------------------------------------------ CLI

TINY_SET = ["--set", "dim=32", "--set", "depth=1", "--set", "heads=2", "--set", "chunk_size=8"]
TINY_SET += ["--set", "segment_len=32", "--set", "window=32", "--threads", "1"]
RECIPE = ["--steps", "2", "--batch-size", "2", "--train-length", "320", "--start-length", "288"]


def run_cli(argv: list[str]) -> int:
    from titans.cli import main

    return main(argv)


def read_json(path):
    return json.loads(path.read_text())


def test_cli_niah_trains_saves_and_reloads(tmp_path, capsys):
    out = tmp_path / "res"
    argv = ["eval", "niah", "--train-recipe", "--variant", "lmm", *TINY_SET, *RECIPE]
    argv += ["--lengths", "300,400", "--depths", "0,1", "--samples", "1", "--out", str(out), "--name", "a"]
    argv += ["--save-model", str(tmp_path / "model"), "--memory-alpha-init", "1e-3"]
    assert run_cli(argv) == 0
    data = read_json(out / "a.json")
    assert (out / "a.png").stat().st_size > 0
    assert {c["length"] for c in data["cells"]} == {300, 400} and data["metadata"]["variant"] == "lmm"
    assert len(data["metadata"]["samples"]) == 4
    assert "depth=0" in capsys.readouterr().out
    # the saved model reloads through the trainer's load_model and gives the same predictions
    argv = [
        "eval",
        "niah",
        "--checkpoint",
        str(tmp_path / "model"),
        "--lengths",
        "300,400",
        "--depths",
        "0,1",
    ]
    argv += ["--samples", "1", "--out", str(out), "--name", "b", "--threads", "1"]
    assert run_cli(argv) == 0
    reloaded = read_json(out / "b.json")["metadata"]
    predictions = [s["prediction"] for s in data["metadata"]["samples"]]
    assert [s["prediction"] for s in reloaded["samples"]] == predictions
    # the record names the checkpoint's variant, not the unused fresh-model default (mac)
    assert reloaded["variant"] == "lmm" and "variant" not in reloaded["command"]
    # the step folder scored, not the run folder as typed (which may train on)
    assert reloaded["model"]["checkpoint"] == str(tmp_path / "model" / "checkpoints" / "step_00000002")
    # the gate-init flag is a config field: the checkpoint carries it
    assert reloaded["model"]["model_config"]["memory_alpha_init"] == 1e-3
    # --checkpoint with --train-recipe fine-tunes the saved model (a second stage) and saves it again
    argv = [
        "eval",
        "niah",
        "--checkpoint",
        str(tmp_path / "model"),
        "--train-recipe",
        *RECIPE,
        "--steps",
        "1",
    ]
    argv += ["--lengths", "300", "--depths", "0", "--samples", "1", "--out", str(out), "--name", "c"]
    argv += ["--save-model", str(tmp_path / "stage2"), "--threads", "1"]
    assert run_cli(argv) == 0
    model = read_json(out / "c.json")["metadata"]["model"]
    training = model["training"]
    assert training["fine_tuned_from"] == str(tmp_path / "model") and training["earlier"]["steps_done"] == 2
    # the model scored is the one saved now; the base checkpoint was named as if it were scored
    assert model["checkpoint"] == model["saved"] == str(tmp_path / "stage2" / "checkpoints" / "step_00000001")
    assert model["fine_tuned_from"] == reloaded["model"]["checkpoint"]
    # a recipe model trained on prompts of up to --train-length tokens, none from its config's data
    saved = load_checkpoint_from(tmp_path / "stage2")
    assert saved.config["train"]["seq_len"] == 320  # it was TrainConfig's default, 256
    for command in (["ppl"], ["context", "--length", "300", "--windows", "1"]):
        argv = ["eval", *command, "--checkpoint", str(tmp_path / "stage2"), "--out", str(out / "p.json")]
        assert run_cli(argv) == 2
        assert "trained by the task recipe on generated prompts" in capsys.readouterr().err
    assert (tmp_path / "stage2" / "checkpoints").is_dir()
    assert run_cli(["eval", "niah", "--lengths", "300", "--out", str(out)]) == 2  # no model source


def test_cli_babilong(tmp_path):
    argv = ["eval", "babilong", "--train-recipe", "--variant", "mag", *TINY_SET, *RECIPE, "--tasks", "qa1"]
    argv += [
        "--train-length",
        "400",
        "--num-facts",
        "2",
        "--lengths",
        "400,480",
        "--samples",
        "2",
        "--out",
        str(tmp_path),
        "--name",
        "b",
    ]
    assert run_cli(argv) == 0
    data = read_json(tmp_path / "b.json")
    assert data["col_name"] == "task" and {c["task"] for c in data["cells"]} == {"qa1"}
    assert (tmp_path / "b.png").exists()


# lengths 300 and 400, with full attention allowed only up to 350
EVAL_300_400 = ["--eval-lengths", "300,400", "--depths", "0.5", "--samples", "1"]
EVAL_300_400 += ["--max-attention-length", "350"]


def test_cli_tasks_marks_skipped_full_attention_and_reloads(tmp_path, capsys, monkeypatch):
    argv = ["eval", "tasks", "--task", "niah", "--variants", "lmm,transformer", *TINY_SET, *RECIPE]
    argv += EVAL_300_400
    argv += ["--out", str(tmp_path), "--name", "t", "--save-models", str(tmp_path / "models")]
    assert run_cli(argv) == 0
    data = read_json(tmp_path / "t.json")
    cells = {(c["length"], c["variant"]) for c in data["cells"]}
    assert cells == {(300, "lmm"), (400, "lmm"), (300, "transformer")}
    assert data["metadata"]["variants"]["transformer"]["skipped_lengths"] == [400]
    assert "not evaluated at [400]" in capsys.readouterr().out
    assert (tmp_path / "t.png").exists()
    # evaluating the saved models again gives the same table, without training
    argv = ["eval", "tasks", "--variants", "lmm,transformer", "--from-models", str(tmp_path / "models")]
    argv += EVAL_300_400
    argv += ["--out", str(tmp_path), "--name", "t2", "--threads", "1"]
    assert run_cli(argv) == 0
    again = read_json(tmp_path / "t2.json")
    assert again["cells"] == data["cells"]
    lmm = again["metadata"]["variants"]["lmm"]
    assert lmm["training"]["recipe"]["steps"] == 2 and "training:" not in capsys.readouterr().out
    # a saved model of another tokenizer with as many symbols: its prompts would be --tokenizer's ids
    real = eval_cli.load_task_model

    class OtherBytes(ByteTokenizer):
        fingerprint = "bytes:another"

    def with_other_tokenizer(path, device):
        model, _, entry = real(path, device)
        return model, OtherBytes(), entry

    monkeypatch.setattr(eval_cli, "load_task_model", with_other_tokenizer)
    assert run_cli([*argv[:-4], "--name", "t3", "--threads", "1"]) == 2
    assert "was trained with tokenizer 'bytes', not --tokenizer 'bytes'" in capsys.readouterr().err
    assert not (tmp_path / "t3.json").exists()


@pytest.fixture
def text_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TITANS_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "text"
    folder.mkdir()
    words = ["the", "memory", "learns", "to", "remember", "surprising", "tokens", "while", "it", "reads"]
    for i in range(24):
        body = " ".join(words[(i + j) % len(words)] for j in range(400))
        (folder / f"doc{i:02d}.txt").write_text(body + "\n")
    return folder


def test_cli_ablate(tmp_path, text_folder):
    argv = ["eval", "ablate", "--rows", "full,no_conv,no_persistent", *TINY_SET, "--data", str(text_folder)]
    argv += ["--heldout-fraction", "0.3", "--seq-len", "32", "--lm-steps", "2", "--lm-batch-size", "2"]
    argv += ["--heldout-windows", "2", "--task-steps", "1", "--batch-size", "2", "--train-length", "320"]
    argv += [
        "--eval-lengths",
        "300",
        "--depths",
        "0.5",
        "--samples",
        "1",
        "--out",
        str(tmp_path),
        "--name",
        "ab",
    ]
    assert run_cli(argv) == 0
    rows = read_json(tmp_path / "ab.json")["rows"]
    assert [r["name"] for r in rows] == ["full", "no_conv", "no_persistent"]
    assert all(r["heldout_loss"] > 0 and 0 <= r["niah_accuracy"] <= 1 for r in rows)
    assert rows[1]["overrides"]["memory_conv_kernel"] == 0
    assert (tmp_path / "ab.png").exists()


def test_cli_depth(tmp_path, text_folder):
    argv = ["eval", "depth", "--depths", "1,2", *TINY_SET, "--data", str(text_folder)]
    argv += ["--heldout-fraction", "0.3", "--seq-len", "32", "--lm-steps", "2", "--lm-batch-size", "2"]
    argv += ["--heldout-windows", "2", "--eval-lengths", "32,64", "--throughput-lengths", "32"]
    argv += ["--throughput-repeats", "1", "--out", str(tmp_path), "--name", "d"]
    assert run_cli(argv) == 0
    rows = read_json(tmp_path / "d.json")["rows"]
    assert [r["memory_depth"] for r in rows] == [1, 2]
    assert all(set(r["heldout_loss"]) == {"32", "64"} and r["tokens_per_s"]["32"] > 0 for r in rows)
    assert (tmp_path / "d.png").exists()


def test_cli_reports_bad_arguments(tmp_path, capsys):
    argv = ["eval", "ablate", "--rows", "full,no_brain", "--out", str(tmp_path)]
    assert run_cli(argv) == 2
    assert "no_brain" in capsys.readouterr().err
    # options that configure a fresh model are refused next to a checkpoint, which has its own config
    argv = ["eval", "niah", "--checkpoint", str(tmp_path), "--set", "memory_depth=3", "--out", str(tmp_path)]
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert "--set" in err and "--checkpoint" in err


def test_every_variant_recipe_builds_its_config_and_model():
    """The per-variant pass-key recipes (`titans.evaluation.recipe.RECIPES`) are options `titans eval niah
    --train-recipe` accepts, and give the documented schedules and memory settings."""
    from titans.cli import build_parser
    from titans.evaluation.args import model_overrides
    from titans.evaluation.recipe import BASE_RECIPE, RECIPES, task_config, variant_recipe
    from titans.models.config import VARIANTS

    assert set(RECIPES) <= set(VARIANTS) and variant_recipe("no_such") == variant_recipe("lmm")
    assert RECIPES["lmm"] == BASE_RECIPE
    for variant in RECIPES:
        argv = ["eval", "niah", "--train-recipe", "--variant", variant, *variant_recipe(variant)]
        args = build_parser().parse_args(argv)
        cfg = task_config(args, "niah")
        assert cfg.train_length == 1024 and cfg.start_length == 320 and cfg.batch_size == 8
        assert cfg.steps == {"mac": 1500, "transformer": 5000}.get(variant, 800)
        assert cfg.hold_lr == (variant == "mac") and cfg.lm_loss_weight == 0.1
        # the --set overrides make a valid model config
        config = TitansConfig.preset(args.preset, variant=variant, vocab_size=256, **model_overrides(args))
        if variant != "transformer":
            assert config.memory_conv_kernel == 8 and not config.memory_forgetting


def test_hold_lr_can_be_turned_off_and_a_negative_warmup_is_refused(capsys):
    """`--no-hold-lr` undoes MAC's `--hold-lr` (a later flag wins), so `--recipe-extra` can give the plain
    cosine; a negative `--warmup-steps` is refused when parsed, and by TaskTrainConfig."""
    from titans.cli import build_parser
    from titans.evaluation.recipe import task_config, variant_recipe

    base = ["eval", "niah", "--train-recipe", "--variant", "mac", *variant_recipe("mac")]
    assert task_config(build_parser().parse_args(base), "niah").hold_lr
    assert not build_parser().parse_args([*base, "--no-hold-lr"]).hold_lr
    assert not build_parser().parse_args([*base, "--hold-lr", "--no-hold-lr"]).hold_lr
    assert build_parser().parse_args([*base, "--no-hold-lr", "--hold-lr"]).hold_lr
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*base, "--warmup-steps", "-1"])
    assert e.value.code == 2 and "expected an integer >= 0, got '-1'" in capsys.readouterr().err
    assert build_parser().parse_args([*base, "--warmup-steps", "0"]).warmup_steps == 0
    with pytest.raises(ValueError, match="TaskTrainConfig.warmup_steps must be an integer >= 0, got -1"):
        TaskTrainConfig(warmup_steps=-1)


def test_cli_recipe_checkpoints_and_a_signal_saves_the_model_and_ends(tmp_path, monkeypatch, capsys):
    """`--save-model` with `--ckpt-every`: the model is saved during training (the shared training loop's
    checkpoints), and a SIGINT stops training after the current step, saves it and ends with status 130."""
    import signal

    from titans.evaluation.recipe import load_task_model
    from titans.runtime.checkpoint import list_checkpoints
    from titans.training.loop import TrainLoop

    saved_steps: list[int] = []
    real_save = recipe_module.save_task_model
    monkeypatch.setattr(
        recipe_module,
        "save_task_model",
        lambda path, model, tok, args, summary, *a: (
            saved_steps.append(summary["steps_done"]) or real_save(path, model, tok, args, summary, *a)
        ),
    )
    real_step = TrainLoop.default_step

    def step(self, s):
        if s == 2:
            signal.raise_signal(signal.SIGINT)
        return real_step(self, s)

    monkeypatch.setattr(TrainLoop, "default_step", step)
    argv = ["eval", "niah", "--train-recipe", "--variant", "lmm", *TINY_SET, *RECIPE, "--steps", "6"]
    argv += ["--lengths", "300", "--samples", "1", "--out", str(tmp_path / "res")]
    argv += ["--save-model", str(tmp_path / "model"), "--ckpt-every", "2"]
    with pytest.raises(SystemExit) as stopped:
        run_cli(argv)
    assert stopped.value.code == 130
    assert saved_steps == [2, 3, 3]  # every 2 steps, the loop's last checkpoint, the command's save
    assert [p.name for p in list_checkpoints(tmp_path / "model")] == ["step_00000003"]
    _, _, info = load_task_model(tmp_path / "model", "cpu")
    assert info["training"]["steps_done"] == 3 and info["training"]["final"]["stopped_by"] == "SIGINT"
    assert "stopped by SIGINT at step 3" in capsys.readouterr().err
    assert not (tmp_path / "res").exists()  # no evaluation after the stop
    argv = ["eval", "niah", "--train-recipe", *TINY_SET, *RECIPE, "--ckpt-every", "2"]
    assert run_cli(argv) == 2  # nowhere to save
    assert "--ckpt-every saves the model being trained" in capsys.readouterr().err
