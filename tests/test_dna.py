"""DNA: the tokenizer round trip, FASTA reading (plain, gzip, bad letters), the fasta: source through the
trainer, the proximal/distal task, GenomicsBenchmarks-format labelled sequences, the classifier, its
training under the convergence rules, the study's record split, from-scratch classifiers and seeds."""

from __future__ import annotations

import gzip
import json
import re

import numpy as np
import pytest
import torch

from titans._fs import lock_folder
from titans.data.dna import DNATokenizer, FastaRecord, dm3_sample_path, load_labelled_sequences, read_fasta
from titans.data.sources import load_source
from titans.data.tokenizers import load_tokenizer
from titans.dna.model import SequenceClassifier, dna_config, lm_bits_per_base
from titans.dna.study import DNABudget, finetune, fresh_lm, mean_loss, run_study, summarise_seeds
from titans.dna.tasks import (
    ClassificationSet,
    encode_records,
    lm_windows,
    markov_bits_per_base,
    proximal_distal,
    split_records,
)
from titans.models.lm import TitansLM

FASTA = """>chr1 first record
ACGTNacgtn
ACG
; a comment line
>chr2
ttttGGGGccccAAAA
"""


def test_tokenizer_round_trip_and_unknown_letters():
    tok = DNATokenizer()
    assert load_tokenizer("dna").vocab_size == tok.vocab_size == 8
    seq = "ACGTNNacgtGATTACA"
    ids = tok.encode(seq)
    assert len(ids) == len(seq) and min(ids) >= 3  # specials are never produced by sequence
    assert tok.decode(ids) == seq.upper()
    assert tok.decode([tok.cls_id, *ids, tok.eos_id, tok.pad_id]) == seq.upper()  # specials drop out
    with pytest.raises(ValueError, match=r"unknown letter 'X' at position 5"):
        tok.encode("ACGTAXGT")
    with pytest.raises(ValueError, match="id 8 outside"):
        tok.decode([3, 8])


@pytest.mark.parametrize("gz", [False, True])
def test_read_fasta_plain_and_gzip(tmp_path, gz):
    path = tmp_path / ("x.fa.gz" if gz else "x.fa")
    with gzip.open(path, "wt") if gz else open(path, "w") as f:
        f.write(FASTA)
    recs = read_fasta(path)
    assert [r.name for r in recs] == ["chr1 first record", "chr2"]
    assert recs[0].sequence == "ACGTNACGTNACG" and recs[1].sequence == "TTTTGGGGCCCCAAAA"
    # a UTF-8 byte-order mark (Windows editors write one) was read as text before the first header
    marked = tmp_path / ("m.fa.gz" if gz else "m.fa")
    data = "\ufeff".encode() + FASTA.encode()
    marked.write_bytes(gzip.compress(data) if gz else data)
    assert read_fasta(marked) == recs


def test_fasta_bad_input(tmp_path):
    bad = tmp_path / "bad.fa"
    bad.write_text(">ok\nACGT\n>second\nACGT\nACZT\n")
    with pytest.raises(ValueError, match=r"unknown letter 'Z' in record 'second' at line 5, column 3"):
        read_fasta(bad)
    # with ambiguous='N' the IUPAC codes are accepted: the letter named is the first one refused
    (tmp_path / "mixed.fa").write_text(">r1\nACGTRX\n")
    with pytest.raises(
        ValueError,
        match=r"unknown letter 'X' in record 'r1' at line 2, column 6 \(expected A, C, G, T or N\)$",
    ):
        read_fasta(tmp_path / "mixed.fa", ambiguous="N")
    with pytest.raises(ValueError, match=r"unknown letter 'R' .* column 5 .*ambiguous='N' maps IUPAC"):
        read_fasta(tmp_path / "mixed.fa")
    iupac = tmp_path / "iupac.fa"
    iupac.write_text(">r\nACRYGT\n")
    with pytest.raises(ValueError, match="ambiguous='N' maps IUPAC"):
        read_fasta(iupac)
    assert read_fasta(iupac, ambiguous="N")[0].sequence == "ACNNGT"
    # a letter outside ASCII whose upper case is one ("ſ" -> "S", an IUPAC code) is refused, not an N
    (tmp_path / "long_s.fa").write_text(">r\nAC\u017fGT\n", encoding="utf-8")
    with pytest.raises(ValueError, match="unknown letter 'ſ' in record 'r' at line 2, column 3"):
        read_fasta(tmp_path / "long_s.fa", ambiguous="N")
    (tmp_path / "headless.fa").write_text("ACGT\n")
    with pytest.raises(ValueError, match="before the first '>' header"):
        read_fasta(tmp_path / "headless.fa")
    (tmp_path / "empty.fa").write_text(">a\n>b\nAC\n")
    with pytest.raises(ValueError, match="record 'a' has no sequence"):
        read_fasta(tmp_path / "empty.fa")
    with pytest.raises(FileNotFoundError):
        read_fasta(tmp_path / "missing.fa")


def test_fasta_source_trains_through_the_trainer(tmp_path):
    from micro_train import micro_config
    from titans.training.trainer import Trainer

    (tmp_path / "g.fa").write_text(FASTA)
    src = load_source(f"fasta:{tmp_path / 'g.fa'}")
    assert src.document_ids() == ["chr1 first record", "chr2"]
    assert [d.text for d in src.documents()] == ["ACGTNACGTNACG", "TTTTGGGGCCCCAAAA"]
    # the built-in sample through the trainer with the dna tokenizer: one byte per base, so bpb = bits/base
    cfg = micro_config(
        tmp_path / "run",
        tmp_path / "cache",
        data="fasta:builtin",
        tokenizer="dna",
        steps=2,
        batch_size=2,
        warmup_steps=1,
        eval_every=1000,
        eval_windows=2,
        ckpt_every=1000,
    )
    trainer = Trainer(cfg)
    assert trainer.model_config.vocab_size >= DNATokenizer.vocab_size
    trainer.train()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["step"] == 2 and report["eval"]["bpb"] == pytest.approx(
        report["eval"]["loss"] / np.log(2), rel=1e-5
    )


def test_builtin_sample_and_proximal_distal_task():
    recs = read_fasta(dm3_sample_path())
    assert len(recs) == 530 and all(len(r.sequence) == 2000 for r in recs)
    train, test = split_records(recs)
    assert len(test) == 106 and not {r.name for r in train} & {r.name for r in test}
    task = proximal_distal(test, length=250)
    assert task.x.shape[1] == 250 and set(task.y.tolist()) == {0, 1}
    # the labels follow the position: label 1 rows are the tail of a record
    tok = DNATokenizer()
    assert tok.decode(task.x[0].tolist()) == test[0].sequence[-250:] and task.y[0] == 1


def test_markov_reference_beats_uniform_on_skewed_sequence():
    rng = np.random.default_rng(0)
    seqs = [rng.choice([3, 6], size=600, p=[0.9, 0.1]) for _ in range(4)]  # mostly A
    bits = markov_bits_per_base(seqs[:3], lm_windows(seqs[3:], 100), order=1)
    assert 0.3 < bits < 0.7  # entropy of (0.9, 0.1) is 0.47 bits, far below log2(5)


def test_classifier_and_lm_bits_per_base():
    torch.manual_seed(0)
    lm = TitansLM(dna_config("lmm", dim=16, depth=1, heads=2, window=16))
    windows = np.random.default_rng(0).integers(3, 7, size=(3, 33))
    bpb = lm_bits_per_base(lm, windows)
    assert 1.5 < bpb < 4.0  # an untrained model over 8 ids: near log2(8) = 3
    clf = SequenceClassifier(lm, num_classes=2)
    logits = clf(torch.from_numpy(windows))
    assert logits.shape == (3, 2)
    logits.sum().backward()
    assert lm.embed.weight.grad is not None  # fine-tuning reaches the pre-trained backbone
    with pytest.raises(ValueError, match="token ids must lie in"):
        clf(torch.full((1, 5), 9))


def test_genomic_benchmarks_format(tmp_path):
    # GenomicsBenchmarks on the hub: columns seq and label; a local CSV / JSONL / save_to_disk folder
    rows = [{"seq": "ACGTTGCA", "label": 1}, {"seq": "acgtn", "label": 0}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_labelled_sequences(str(tmp_path / "train.jsonl")) == [("ACGTTGCA", 1), ("ACGTN", 0)]
    (tmp_path / "bad.csv").write_text("seq,label\nACGT,1\nACXT,0\n")
    with pytest.raises(ValueError, match=r"row 1: DNATokenizer: unknown letter 'X' at position 2"):
        load_labelled_sequences(str(tmp_path / "bad.csv"))
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "hub_copy"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(folder))
    assert load_labelled_sequences(f"hf:{folder}::test")[0] == ("ACGTTGCA", 1)


@pytest.mark.parametrize(
    "train_labels, test_labels, extra, want",
    [
        ([-1, 0], [-1, 0], [], "row 0: the label -1 is not a class id (an integer >= 0)"),
        (["neg", "pos"], [0, 1], [], "row 0: the label 'neg' is not a class id"),
        (
            [1e300, 0],
            [0, 1],
            [],
            "row 0: the label 1e+300 is too large a class id (at most 9223372036854775807, the",
        ),
        ([2**63, 0], [0, 1], [], "row 0: the label 9223372036854775808 is too large a class id"),
        (["nan", 0], [0, 1], [], "row 0: the label 'nan' is not a class id"),
        ([1.5, 0], [0, 1], [], "row 0: the label 1.5 is not a class id"),
        ([0, 1], [0, 2], [], "label(s) [2] never occur in --train"),
        ([1, 1], [1, 1], [], "every row has the same label"),
        ([0, 1], [0, 1], ["--length", "0"], "--length must be >= 1, got 0"),
    ],
)
def test_dna_classify_refuses_labels_it_cannot_learn(
    tmp_path, capsys, train_labels, test_labels, extra, want
):
    """Class ids are integers from 0, every test class occurs in training, and there are two classes: -1/0
    read as one class ("num_classes must be >= 2"), an unseen test class was scored as always wrong, a
    non-integer label named no file or row, and --length 0 meant the longest sequence."""
    from titans.cli import main

    def write(name, labels):
        rows = [f"{'ACGT' * 4},{labels[i % len(labels)]}" for i in range(6)]
        (tmp_path / name).write_text("seq,label\n" + "\n".join(rows) + "\n")
        return str(tmp_path / name)

    argv = [
        "dna",
        "classify",
        "--train",
        write("train.csv", train_labels),
        "--test",
        write("test.csv", test_labels),
    ]
    assert main([*argv, "--finetune-steps", "1", "--dim", "16", "--heads", "2", "--no-progress", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("titans dna classify: error: ") and want in err, err


def test_dna_classify_cli(tmp_path):
    from titans.cli import main

    rng = np.random.default_rng(0)
    lines = ["seq,label"] + [f"{''.join(rng.choice(list('ACGT'), 24))},{i % 2}" for i in range(12)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    argv = [
        "dna",
        "classify",
        "--train",
        str(tmp_path / "t.csv"),
        "--test",
        str(tmp_path / "t.csv"),
        "--variant",
        "swa",
        "--finetune-steps",
        "2",
        "--dim",
        "16",
        "--depth",
        "1",
        "--heads",
        "2",
        "--window",
        "16",
        "--no-progress",
    ]
    assert main(argv) == 0


def test_dna_classify_gives_one_output_per_class_whatever_its_id(tmp_path, capsys):
    """Labels 7 and 10**12: the head had one output per id up to the largest (a 64 TB weight, and an
    allocation failure); now two outputs, and the JSON names the classes in output order."""
    from titans.cli import main

    rng = np.random.default_rng(0)
    labels = (7, 10**12)
    lines = ["seq,label"] + [f"{''.join(rng.choice(list('ACGT'), 24))},{labels[i % 2]}" for i in range(12)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    data = ["--train", str(tmp_path / "t.csv"), "--test", str(tmp_path / "t.csv")]
    tiny = ["--variant", "swa", "--finetune-steps", "2", "--dim", "16", "--depth", "1", "--heads", "2"]
    assert main(["dna", "classify", *data, *tiny, "--window", "16", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["classes"] == [7, 10**12] and 0 <= report["test_accuracy"] <= 1


def _tiny_budget(**kw) -> DNABudget:
    return DNABudget(
        **{
            "pretrain_steps": 2,
            "finetune_steps": 40,
            "batch_size": 4,
            "seq_len": 32,
            "window_len": 24,
            "dim": 16,
            "depth": 1,
            "heads": 2,
            "window": 16,
            "eval_windows": 4,
            **kw,
        }
    )


def test_finetune_early_stopping_restores_the_best_weights():
    # a task no model can learn (random labels): validation loss stops improving, patience ends training
    # early, and the classifier returned holds the weights of the best check, not the last step's
    rng = np.random.default_rng(0)
    train = ClassificationSet(rng.integers(3, 7, (64, 24)), rng.integers(0, 2, 64))
    val = ClassificationSet(rng.integers(3, 7, (20, 24)), rng.integers(0, 2, 20))
    budget = _tiny_budget(finetune_lr=1e-2, val_every=3, patience=2)
    clf, rec = finetune(fresh_lm("swa", budget), train, budget, val=val)
    assert rec["stopped_by"] == "early stopping" and rec["steps_done"] < 40
    assert rec["steps_done"] == rec["best_step"] + 2 * 3  # two checks without improvement after the best
    assert mean_loss(clf, val) == pytest.approx(rec["val_loss"], rel=1e-6)
    assert min(v for _, v in rec["val_curve"]) == rec["val_loss"] and rec["val_curve"][0][0] == 0
    # without a validation set the rules cannot apply: refused rather than silently ignored
    with pytest.raises(ValueError, match="patience and time_budget need a validation set"):
        finetune(fresh_lm("swa", budget), train, budget)
    clf, rec = finetune(
        fresh_lm("swa", _tiny_budget(finetune_steps=3)), train, _tiny_budget(finetune_steps=3)
    )
    assert rec["steps_done"] == 3 and "best_step" not in rec


def test_study_splits_records_three_ways_and_trains_from_scratch_beside():
    rng = np.random.default_rng(1)
    records = [FastaRecord(f"r{i}", "".join(rng.choice(list("ACGT"), 80))) for i in range(40)]
    budget = _tiny_budget(finetune_steps=4, val_every=2, patience=3)
    res = run_study(records, ["swa"], budget, log=lambda m: None)
    # 40 records: 8 test (every fifth), of the other 32 every eighth is validation (4), 28 train
    assert res["records"] == {"train": 28, "val": 4, "test": 8}
    assert res["classification"] == {"train": 56, "val": 8, "test": 16, "test_positive_fraction": 0.5}
    row = res["variants"]["swa"]
    assert 0 <= row["scratch_test_accuracy"] <= 1 and row["scratch"]["steps_done"] <= 4
    assert row["finetune"]["best_step"] <= row["finetune"]["steps_done"] <= 4
    # the from-scratch model starts from the untrained LM pre-training starts from: same weights
    a, b = fresh_lm("swa", budget).state_dict(), fresh_lm("swa", budget).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (
        "scratch"
        not in run_study(records, ["swa"], budget, log=lambda m: None, scratch=False)["variants"]["swa"]
    )


def test_summary_over_seeds():
    runs = [
        {"variants": {"lmm": {"parameters": 5, "test_bits_per_base": b, "test_accuracy": a}}}
        for b, a in ((1.9, 0.6), (2.0, 0.7), (2.1, 0.8))
    ]
    s = summarise_seeds(runs)["lmm"]
    assert s["seeds"] == 3 and "scratch_test_accuracy" not in s
    assert s["test_accuracy"]["mean"] == pytest.approx(0.7) and s["test_accuracy"]["std"] == pytest.approx(
        0.1
    )
    assert s["test_bits_per_base"]["sem"] == pytest.approx(0.1 / 3**0.5)
    assert summarise_seeds(runs[:1])["lmm"]["test_accuracy"]["std"] == 0.0


def test_dna_study_seeds_option_is_checked(tmp_path, capsys):
    from titans.cli import main

    for bad in ("0,x", "1,1"):
        with pytest.raises(SystemExit) as exit_:
            main(["dna", "study", "--seeds", bad, "--out", str(tmp_path), "--no-progress"])
        assert exit_.value.code == 2 and "--seeds: expected" in capsys.readouterr().err


def test_dna_study_resume_keeps_finished_seeds(tmp_path, capsys):
    from titans.cli import main

    rng = np.random.default_rng(2)
    fasta = tmp_path / "g.fa"
    fasta.write_text("".join(f">r{i}\n{''.join(rng.choice(list('ACGT'), 80))}\n" for i in range(40)))
    out = tmp_path / "out"
    tiny = (
        "--variants swa --pretrain-steps 2 --finetune-steps 4 --val-every 2 --eval-windows 4 --window-len 24"
    )
    tiny += (
        f" --seq-len 32 --dim 16 --depth 1 --heads 2 --window 16 --no-progress --fasta {fasta} --out {out}"
    )
    assert main(["dna", "study", *tiny.split(), "--seeds", "0"]) == 0
    first = json.loads((out / "dna.json").read_text())["runs"][0]
    assert main(["dna", "study", *tiny.split(), "--seeds", "0,1", "--resume"]) == 0
    doc = json.loads((out / "dna.json").read_text())
    assert doc["seeds"] == [0, 1] and doc["runs"][0] == first and doc["runs"][1]["budget"]["seed"] == 1
    assert "seed 0: kept from" in capsys.readouterr().out
    # seeds not named again stay: --resume --seeds 2 extends the study (it kept 2 alone, losing 0 and 1)
    assert main(["dna", "study", *tiny.split(), "--seeds", "2", "--resume"]) == 0
    extended = json.loads((out / "dna.json").read_text())
    assert extended["seeds"] == [0, 1, 2] and extended["runs"][:2] == doc["runs"]
    assert "seed 1: kept from" in capsys.readouterr().out
    # a second study into the folder while one writes it is refused before any work (both ran, and the
    # last to finish kept only its own seeds)
    with lock_folder(out, "held"):
        assert main(["dna", "study", *tiny.split(), "--seeds", "2"]) == 2
    assert "is in use: another dna study writes it" in capsys.readouterr().err
    assert json.loads((out / "dna.json").read_text())["seeds"] == [0, 1, 2]
    # another budget: nothing is kept
    assert main(["dna", "study", *tiny.split(), "--seeds", "0", "--resume", "--finetune-lr", "1e-3"]) == 0
    assert "kept from" not in capsys.readouterr().out
    assert json.loads((out / "dna.json").read_text())["runs"][0]["budget"]["finetune_lr"] == 1e-3
    # a run whose split counts or references differ from this version's (one scored otherwise): not kept
    path = out / "dna.json"
    doc = json.loads(path.read_text())
    doc["runs"][0]["reference"]["markov0_bits_per_base"] += 0.01
    path.write_text(json.dumps(doc))
    assert main(["dna", "study", *tiny.split(), "--seeds", "0", "--resume", "--finetune-lr", "1e-3"]) == 0
    assert "kept from" not in capsys.readouterr().out
    rerun = json.loads(path.read_text())["runs"][0]
    assert rerun["reference"] == first["reference"] and "dropped" in rerun
    # a damaged dna.json: a traceback (a list, a run that is a number) or an error naming no file
    for damaged in ("[1, 2]", '{"runs": [5]}', ""):
        path.write_text(damaged)
        assert main(["dna", "study", *tiny.split(), "--seeds", "0", "--resume"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "dna.json' is not a readable dna study JSON" in err
        assert path.read_text() == damaged


def _study_without_training(monkeypatch, records, budget):
    """``run_study`` with the training and scoring stubbed out (seconds): (results, what it was given:
    the LM's training sequences and test windows, the classification train / val / test sets)."""
    import titans.dna.study as study

    seen: dict = {}

    def pretrain(variant, train, budget, progress=False, **kw):
        seen["train_seqs"] = train
        return fresh_lm(variant, budget), [0.0]

    def bits(lm, windows):
        seen["test_windows"] = windows
        return 0.0

    def tune(lm, train, budget, progress=False, *, val=None, **kw):
        seen["train"], seen["val"] = train, val
        return None, {"train_seconds": 0.0}

    def accuracy(clf, data, batch_size=64):
        seen["test"] = data
        return 0.0

    for name, fn in (("pretrain", pretrain), ("lm_bits_per_base", bits), ("finetune", tune)):
        monkeypatch.setattr(study, name, fn)
    monkeypatch.setattr(study, "accuracy", accuracy)
    res = run_study(records, ["swa"], budget, log=lambda m: None, scratch=False)
    return res, seen


def _random_records(n: int, length: int = 80, seed: int = 3) -> list[FastaRecord]:
    rng = np.random.default_rng(seed)
    return [FastaRecord(f"r{i}", "".join(rng.choice(list("ACGT"), length))) for i in range(n)]


def test_study_keeps_a_repeated_record_or_window_in_one_split(monkeypatch):
    """A record repeated in the file (transcripts sharing a start) and a record sharing only its proximal
    window with a training record: neither reaches val or test, so no val / test sequence was trained on."""
    records = _random_records(40)
    records[4] = FastaRecord("r4", records[0].sequence)  # record 4 (a test record) repeats record 0
    records[9] = FastaRecord("r9", records[1].sequence)  # and record 9 repeats record 1
    # record 14 (test) ends like record 2 (train): the same proximal window, another distal one
    records[14] = FastaRecord("r14", records[14].sequence[:-24] + records[2].sequence[-24:])
    records[38] = FastaRecord("r38", records[3].sequence)  # record 38 (val) repeats record 3
    res, seen = _study_without_training(monkeypatch, records, _tiny_budget())
    assert res["records"] == {"train": 28, "val": 3, "test": 6}
    assert res["dropped"]["records_identical_to_an_earlier_split"] == {"val": 1, "test": 2}
    assert res["dropped"]["task_windows_identical_to_an_earlier_split"] == {"val": 0, "test": 1}
    assert res["classification"] == {"train": 56, "val": 6, "test": 11, "test_positive_fraction": 5 / 11}
    rows = {name: {x.tobytes() for x in seen[name].x} for name in ("train", "val", "test")}
    assert (
        not rows["train"] & rows["val"]
        and not rows["train"] & rows["test"]
        and not rows["val"] & rows["test"]
    )
    train_windows = {w.tobytes() for s in seen["train_seqs"] for w in lm_windows([s], 32)}
    assert not train_windows & {w.tobytes() for w in seen["test_windows"]}


def test_study_of_the_builtin_sample_drops_nothing(monkeypatch):
    """The built-in sample has no repeated record: its split (371 / 53 / 106 records) and windows."""
    res, seen = _study_without_training(monkeypatch, read_fasta(dm3_sample_path()), DNABudget(eval_windows=4))
    assert res["records"] == {"train": 371, "val": 53, "test": 106}
    assert res["classification"] == {"train": 740, "val": 106, "test": 212, "test_positive_fraction": 0.5}
    assert res["dropped"]["records_identical_to_an_earlier_split"] == {"val": 0, "test": 0}
    assert res["dropped"]["task_windows_repeated_within_the_split"] == {"train": 2, "val": 0, "test": 0}


def test_study_leaves_records_too_short_for_the_task_to_the_language_model(monkeypatch):
    records = _random_records(40)
    short = _random_records(1, length=40, seed=9)[0]  # shorter than 2 x window_len = 48, longer than seq_len
    records[0] = FastaRecord("short", short.sequence)
    res, seen = _study_without_training(monkeypatch, records, _tiny_budget())
    assert res["dropped"]["records_too_short_for_the_task"] == {"train": 1, "val": 0, "test": 0}
    assert res["classification"]["train"] == 54  # 27 records of the 28 with a pair
    assert any(np.array_equal(s, encode_records([records[0]])[0]) for s in seen["train_seqs"])


def test_markov_reference_is_scored_on_the_language_models_windows(monkeypatch):
    """The order-0 reference from add-one base counts on exactly the windows the models are scored on."""
    res, seen = _study_without_training(monkeypatch, _random_records(40, length=200), _tiny_budget())
    windows = seen["test_windows"]
    assert len(windows) == 4 < len(lm_windows(encode_records(split_records(_random_records(40, 200))[1]), 32))
    counts = np.ones(8)
    for s in seen["train_seqs"]:
        counts += np.bincount(s, minlength=8)
    p = counts[3:8] / counts[3:8].sum()
    want = -np.mean(np.log2(p[windows[:, 1:] - 3]))
    assert res["reference"]["markov0_bits_per_base"] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("n", [4, 7, 8])
def test_dna_study_refuses_too_few_records(tmp_path, capsys, n):
    from titans.cli import main

    rng = np.random.default_rng(0)
    fasta = tmp_path / "g.fa"
    fasta.write_text("".join(f">r{i}\n{''.join(rng.choice(list('ACGT'), 600))}\n" for i in range(n)))
    argv = "--variants swa --pretrain-steps 1 --finetune-steps 1 --eval-windows 2 --seq-len 64 --dim 16"
    argv += f" --heads 2 --depth 1 --no-progress --fasta {fasta} --out {tmp_path / 'out'}"
    assert main(["dna", "study", *argv.split()]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    want = "the DNA study needs at least 9 FASTA records (every 5th is a test record, every 8th of the rest"
    assert err == f"titans dna study: error: {want} a validation record), got {n}"


def test_dna_study_refuses_a_variant_given_twice(tmp_path, capsys):
    """It trained twice, kept one row, and --resume never matched the study again."""
    from titans.cli import main

    argv = ["dna", "study", "--variants", "swa,swa", "--fasta", str(tmp_path / "none.fa")]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert "--variants has duplicates: ['swa', 'swa']" in capsys.readouterr().err


def test_study_refuses_a_test_split_left_empty_by_repeats(monkeypatch):
    records = _random_records(9)
    records[4] = FastaRecord("r4", records[0].sequence)  # the only test record repeats a train record
    with pytest.raises(
        ValueError, match="no test record left: all 1 are identical to records of an earlier split"
    ):
        _study_without_training(monkeypatch, records, _tiny_budget())
    assert _study_without_training(monkeypatch, _random_records(9), _tiny_budget())[0]["records"] == {
        "train": 7,
        "val": 1,
        "test": 1,
    }


def test_labelled_sequences_refuse_missing_or_empty_sequences(tmp_path):
    """An empty cell, a JSON null or "" is refused naming the row and column, not read as "NAN"; the
    sequence "NA" (N then A) is read as written."""
    (tmp_path / "na.csv").write_text("seq,label\nACGT,1\nNA,0\n")
    assert load_labelled_sequences(str(tmp_path / "na.csv")) == [("ACGT", 1), ("NA", 0)]
    cases = {
        "empty.csv": ("seq,label\nACGT,1\n,0\n", "row 1: column 'seq' is empty"),
        "null.jsonl": (
            '{"seq": "ACGT", "label": 1}\n{"seq": null, "label": 0}\n',
            "row 1: column 'seq' is missing",
        ),
        "blank.jsonl": ('{"seq": "", "label": 1}\n', "row 0: column 'seq' is empty"),
        "number.jsonl": (
            '{"seq": "ACGT", "label": 1}\n{"seq": 12, "label": 0}\n',
            "row 1: column 'seq' is not a sequence (12)",
        ),
    }
    for name, (text, want) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=re.escape(want)):
            load_labelled_sequences(str(tmp_path / name))


def test_dna_classify_reports_test_sequences_cut_to_the_training_length(tmp_path, capsys):
    from titans.cli import main

    (tmp_path / "train.csv").write_text("seq,label\nACGTACGT,1\nGGGGCCCC,0\n")
    (tmp_path / "test.csv").write_text("seq,label\nTTTTTTTTTTTTTTTTGGGGCCCC,1\nACG,0\nACGTACGTA,1\n")
    argv = f"dna classify --train {tmp_path / 'train.csv'} --test {tmp_path / 'test.csv'} --variant swa"
    argv += " --finetune-steps 1 --batch-size 2 --dim 16 --heads 2 --depth 1 --window 16 --no-progress"
    assert main(argv.split()) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["length"] == 8 and doc["train_cut"] == 0 and doc["test_cut"] == 2
    assert "warning: 2 of the 3 --test sequences are longer than 8 bases" in err


def test_dna_study_without_matplotlib_skips_its_plot(tmp_path, capsys, monkeypatch):
    """Without matplotlib (a base install) the study ran to its end, wrote dna.json and then failed with
    "No module named 'matplotlib'", exit 2: a finished study reported as a failure. It skips the plot."""
    import sys

    from titans.cli import main

    rng = np.random.default_rng(3)
    fasta = tmp_path / "g.fa"
    fasta.write_text("".join(f">r{i}\n{''.join(rng.choice(list('ACGT'), 80))}\n" for i in range(40)))
    out = tmp_path / "out"
    argv = "--variants swa --pretrain-steps 2 --finetune-steps 2 --val-every 2 --eval-windows 4"
    argv += " --window-len 24 --seq-len 32 --dim 16 --depth 1 --heads 2 --window 16 --no-progress"
    argv += f" --fasta {fasta} --out {out}"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    assert main(["dna", "study", *argv.split(), "--seeds", "0"]) == 0
    printed = capsys.readouterr().out
    assert "matplotlib is not installed" in printed and f"wrote {out / 'dna.json'}\n" in printed
    assert (out / "dna.json").is_file() and not (out / "dna.png").exists()
