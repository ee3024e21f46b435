"""The bootstrap stage functions and flow, on a handful of steps."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
from safetensors.numpy import load_file

from coba_tasks.engines.bootstrap import (
    GAVE_UP,
    GIVE_UP,
    NEAR_MISSES,
    BootstrapConfig,
    collate,
    draw_batch,
    encode_examples,
    evaluate_greedy,
    init_model,
    level_balanced_weights,
    lr_at,
    near_miss_answers,
    stale_bootstrap_note,
    train_sft,
)
from coba_tasks.engines.fileio import OutputDirError
from coba_tasks.engines.model import TinyLlamaSpec, build_char_tokenizer
from coba_tasks.pipeline.data import load_dataset

SMALL = BootstrapConfig(
    spec=TinyLlamaSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1),
    steps=6,
    batch_size=8,
    warmup_steps=2,
    give_up=0.0,  # a clean teacher unless a test says otherwise
)


@pytest.fixture(scope="module")
def splits():
    train = load_dataset("data/arith_train.parquet")
    test = load_dataset("data/arith_test.parquet")
    return train.sample(200, random_state=0), test.groupby("difficulty").head(4)


def test_char_tokenizer_round_trips():
    tok = build_char_tokenizer()
    for text in ("37+58=95", "(4-7)*3=-9", "Answer: 42"):
        ids = tok(text, add_special_tokens=False).input_ids
        assert len(ids) == len(text) and tok.decode(ids) == text


def test_examples_mask_the_prompt():
    tok = build_char_tokenizer()
    examples = encode_examples(tok, ["1+2=", "10-3="], ["3", "7"])
    assert [n for _, n in examples] == [4, 5]
    assert examples[0][0][-1] == tok.eos_token_id
    ids, mask, labels = collate(examples, tok.pad_token_id)
    assert ids.shape == (2, 7) and mask.sum().item() == 6 + 7
    # labels: only the answer and </s>; the prompt and the padding are -100
    assert labels[0].tolist()[:4] == [-100] * 4 and labels[0, 4].item() == ids[0, 4].item()
    assert labels[0, 6].item() == -100 and labels[1, 5:7].tolist() == ids[1, 5:7].tolist()


def test_level_balanced_weights():
    df = pd.DataFrame({"difficulty": [0, 1, 1, 1, 2, 2]})
    w = level_balanced_weights(df)
    assert w.sum() == pytest.approx(1.0)
    sums = pd.Series(w).groupby(df["difficulty"]).sum()
    assert np.allclose(sums.to_numpy(), 1 / 3)


def test_lr_schedule():
    cfg = BootstrapConfig(steps=100, warmup_steps=10, lr=1e-3)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(99, cfg) == pytest.approx(1e-4, rel=0.05)


def test_training_is_reproducible_and_changes_weights(tmp_path, splits):
    train, test = splits
    init = init_model(tmp_path / "init", SMALL)
    a = train_sft(init, train, tmp_path / "a", SMALL, log=lambda s: None)
    train_sft(init, train, tmp_path / "b", SMALL, log=lambda s: None)
    w0 = load_file(str(init / "model.safetensors"))
    wa = load_file(str(tmp_path / "a" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)
    assert any(not np.array_equal(w0[k], wa[k]) for k in w0)
    assert a["train_tokens"] > 0 and np.isfinite(a["final_loss"])
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (tmp_path / "a" / name).is_file()
    assert not list((tmp_path / "a").glob("*.bin"))  # safetensors only, no pickles
    figures = evaluate_greedy(tmp_path / "a", test, SMALL)
    assert 0.0 <= figures["accuracy"] <= 1.0
    assert sorted(figures["accuracy_by_difficulty"]) == ["0", "1", "2", "3", "4"]


@pytest.mark.slow
def test_bootstrap_flow_end_to_end(tmp_path, prefect_harness, splits):
    from flows.bootstrap import bootstrap_flow

    train, test = splits
    train_path, test_path = tmp_path / "train.parquet", tmp_path / "test.parquet"
    from coba_tasks.pipeline.data import write_verl_parquet

    for df, path in ((train, train_path), (test, test_path)):
        raw = pd.read_parquet("data/arith_train.parquet" if df is train else "data/arith_test.parquet")
        keep = raw[raw["extra_info"].apply(lambda e: str(e["index"])).isin(df["prompt_id"])]
        write_verl_parquet(keep, path)
    out = tmp_path / "model"
    paths = {"train_path": str(train_path), "test_path": str(test_path)}
    figures = bootstrap_flow(out_dir=str(out), cfg=SMALL, **paths)
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "test.parquet", "train.parquet"]  # no temporary
    saved = json.loads((out / "bootstrap.json").read_text())
    assert saved["accuracy"] == figures["accuracy"] and saved["config"]["steps"] == SMALL.steps
    assert saved["files"] == {p.name: p.stat().st_size for p in out.iterdir() if p.name != "bootstrap.json"}

    # an earlier bootstrap is kept without force and replaced with it, keeping nothing of the old one
    with pytest.raises(OutputDirError, match="already holds a bootstrapped model"):
        bootstrap_flow(out_dir=str(out), cfg=SMALL, **paths)
    stale = out / "generation_config.json"
    stale.unlink(missing_ok=True)
    bootstrap_flow(out_dir=str(out), cfg=dataclasses.replace(SMALL, seed=1), force=True, **paths)
    assert json.loads((out / "bootstrap.json").read_text())["config"]["seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "test.parquet", "train.parquet"]


@pytest.mark.slow
def test_bootstrap_never_removes_what_it_did_not_write(tmp_path, prefect_harness, capsys):
    """The flow (a deployment's out_dir), `coba bootstrap --out` and `coba run --bootstrap-if-missing` all refuse
    a directory holding somebody's files, --force included, before any training; nothing there is touched."""
    from coba_tasks.commands.cli import main
    from flows.bootstrap import bootstrap_flow

    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    (home / "bootstrap.json.bak").write_text("{}")
    before = {p.name: p.read_bytes() for p in home.iterdir()}
    for force in (False, True):
        with pytest.raises(OutputDirError, match=r"holds no bootstrap\.json .*nothing was removed"):
            bootstrap_flow(out_dir=str(home), cfg=SMALL, force=force)
        args = ["bootstrap", "--out", str(home), "--steps", "1", *(["--force"] if force else [])]
        assert main(args) == 2
        assert "nothing was removed" in capsys.readouterr().err
    # a model.path without config.json (a parent directory, a cache folder) is not bootstrapped over: only the
    # default tiny model's path is ever bootstrapped (tests/commands/test_cli.py)
    rc = main(["run", "--bootstrap-if-missing", "--run-dir", str(tmp_path / "run"), "--set", f"model.path={home}"])
    assert rc == 2 and "builds only the default tiny model" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in home.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]  # no temporary, no run directory

    # a bootstrap record beside somebody's file: --force still refuses, naming the file
    (home / "bootstrap.json").write_text(json.dumps({"config": {}, "files": {"model.safetensors": 1}}))
    with pytest.raises(OutputDirError, match=r"holds files that no coba bootstrap model build wrote .*thesis\.tex"):
        bootstrap_flow(out_dir=str(home), cfg=SMALL, force=True)
    assert (home / "thesis.tex").read_text() == "years of work"


def test_near_miss_answers_and_label_noise_bounds():
    assert near_miss_answers(["5", "-2", "0"], 10) == ["15", "8", "10"]
    assert near_miss_answers(["5", "-2"], -1) == ["4", "-3"]
    with pytest.raises(ValueError, match="label_noise needs integer answers"):
        near_miss_answers(["1/2"], 1)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="label_noise must be in"):
            BootstrapConfig(label_noise=bad)


def test_draw_batch_gives_near_misses_at_the_noise_rate():
    weights = np.full(50, 1 / 50)
    big = dataclasses.replace(SMALL, batch_size=20_000)
    rows, variant = draw_batch(np.random.default_rng(3), weights, big)
    assert np.array_equal(rows, np.random.default_rng(3).choice(50, size=20_000, p=weights))  # clean: indices only
    assert not variant.any()
    rows, variant = draw_batch(np.random.default_rng(3), weights, dataclasses.replace(big, label_noise=0.3))
    assert rows.min() >= 0 and rows.max() < 50
    assert abs((variant > 0).mean() - 0.3) < 0.02  # 20,000 draws: standard error 0.003
    counts = np.bincount(variant, minlength=len(NEAR_MISSES) + 1)[1:]
    assert len(counts) == len(NEAR_MISSES) and counts.min() > 0.2 * counts.sum()  # each offset about 1/4


def test_label_noise_changes_training_reproducibly(tmp_path, splits):
    """A noisy teacher trains on other answers than the clean one (same seed), the same way every time."""
    train, _ = splits
    init = init_model(tmp_path / "init", SMALL)
    noisy = dataclasses.replace(SMALL, label_noise=0.5)
    train_sft(init, train, tmp_path / "clean", SMALL, log=lambda s: None)
    train_sft(init, train, tmp_path / "n1", noisy, log=lambda s: None)
    train_sft(init, train, tmp_path / "n2", noisy, log=lambda s: None)
    clean, n1, n2 = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("clean", "n1", "n2"))
    assert all(np.array_equal(n1[k], n2[k]) for k in n1)
    assert any(not np.array_equal(clean[k], n1[k]) for k in clean)


def test_give_up_bounds_and_target():
    from coba_tasks.engines.verify import score

    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="give_up must be in"):
            BootstrapConfig(give_up=bad)
    assert score(GIVE_UP, "5", "arith").verdict.value == "no_answer"  # giving up earns no reward


def test_draw_batch_gives_up_at_its_rate_and_keeps_the_clean_draws():
    weights = np.full(50, 1 / 50)
    big = dataclasses.replace(SMALL, batch_size=20_000)
    clean_rows, _ = draw_batch(np.random.default_rng(4), weights, big)
    rows, variant = draw_batch(np.random.default_rng(4), weights, dataclasses.replace(big, give_up=0.4))
    assert np.array_equal(rows, clean_rows)  # the same problems; only their targets differ
    assert set(np.unique(variant)) == {0, GAVE_UP}
    assert abs((variant == GAVE_UP).mean() - 0.4) < 0.02  # 20,000 draws: standard error 0.0035
    both = dataclasses.replace(big, give_up=0.4, label_noise=0.5)
    _, variant = draw_batch(np.random.default_rng(4), weights, both)
    assert abs((variant == GAVE_UP).mean() - 0.2) < 0.02  # only answers that are not near misses
    assert abs(((variant > 0) & (variant < GAVE_UP)).mean() - 0.5) < 0.02


def test_give_up_trains_on_question_marks(tmp_path, splits):
    """A teacher that gives up trains the model towards '?', the same way every time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train, _ = splits
    init = init_model(tmp_path / "init", SMALL)
    quitter = dataclasses.replace(SMALL, give_up=0.9, steps=30, lr=1e-2)
    train_sft(init, train, tmp_path / "q1", quitter, log=lambda s: None)
    train_sft(init, train, tmp_path / "q2", quitter, log=lambda s: None)
    train_sft(init, train, tmp_path / "clean", dataclasses.replace(quitter, give_up=0.0), log=lambda s: None)
    q1, q2 = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("q1", "q2"))
    assert all(np.array_equal(q1[k], q2[k]) for k in q1)
    tok = AutoTokenizer.from_pretrained(tmp_path / "q1")
    ids = tok(train["prompt_text"].head(64).tolist(), return_tensors="pt", padding=True, add_special_tokens=False)
    q = tok(GIVE_UP, add_special_tokens=False).input_ids[0]
    p_give_up = {}
    for name in ("q1", "clean"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        with torch.no_grad():  # right padding: the next-token distribution after each prompt's last token
            logits = model(**ids).logits[torch.arange(64), ids.attention_mask.sum(-1) - 1]
        p_give_up[name] = float(logits.softmax(-1)[:, q].mean())
    assert p_give_up["q1"] > 0.5 > 0.1 > p_give_up["clean"]


def test_stale_bootstrap_note_names_the_rebuild(tmp_path):
    assert stale_bootstrap_note(tmp_path) is None  # no bootstrap.json: someone's own checkpoint
    (tmp_path / "bootstrap.json").write_text(json.dumps({"config": {"steps": 10}}))  # before give_up existed
    note = stale_bootstrap_note(tmp_path)
    assert note is not None and "give_up 0" in note and f"coba bootstrap --out {tmp_path} --force" in note
    default = BootstrapConfig().give_up
    (tmp_path / "bootstrap.json").write_text(json.dumps({"config": {"give_up": default}}))
    assert stale_bootstrap_note(tmp_path) is None
    (tmp_path / "bootstrap.json").write_text("{not json")
    assert stale_bootstrap_note(tmp_path) is None
