"""Several held-out sets (data.extra_tests): which prompts each evaluation scores, and their figures."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from coba_tasks.pipeline.config import check_paths, config_hash, load_config
from coba_tasks.pipeline.config_fields import ConfigError
from coba_tasks.pipeline.data import eval_prompt_set
from coba_tasks.readers.figures import eval_figures, heldout_gains, paired_gain, split_test_sets


def _prompts(prefix: str, n: int) -> pd.DataFrame:
    return pd.DataFrame({"prompt_id": [str(i) for i in range(n)], "prompt_text": [f"{prefix} {i}" for i in range(n)]})


def test_each_extra_set_is_sampled_at_the_same_positions_with_its_own_ids():
    cfg = load_config("configs/tiny-test.yaml", ["data.eval_prompts=5", "run.seed=3"])
    test, other = _prompts("Compute", 40), _prompts("What is", 40)
    held = eval_prompt_set(cfg, test, {"reworded": other})
    main, extra = held[held["test_set"] == "test"], held[held["test_set"] == "reworded"]
    assert len(main) == len(extra) == 5 and held["prompt_id"].is_unique
    assert [p.removeprefix("reworded/") for p in extra["prompt_id"]] == main["prompt_id"].tolist()
    assert [t.replace("What is", "Compute") for t in extra["prompt_text"]] == main["prompt_text"].tolist()
    assert main["prompt_id"].tolist() == test.sample(5, random_state=3)["prompt_id"].tolist()  # as before
    only = eval_prompt_set(cfg, test)
    assert (only["test_set"] == "test").all() and only.drop(columns="test_set").equals(main.drop(columns="test_set"))


def test_extra_tests_in_the_config(tmp_path):
    assert load_config("configs/tiny-test.yaml").data.extra_tests == ()
    cfg = load_config("configs/tiny-test.yaml", ["data.extra_tests=[a/x.parquet, b/y.parquet]"])
    assert cfg.data.extra_tests == ("a/x.parquet", "b/y.parquet")
    assert config_hash(load_config("configs/tiny-test.yaml", ["data.extra_tests=[]"])) == config_hash(
        load_config("configs/tiny-test.yaml")
    )  # added later: at its default the hash of older runs is kept
    for bad, message in (
        ("data.extra_tests=x.parquet", "data.extra_tests: expected a list of strings"),
        ("data.extra_tests=[a/x.parquet, b/x.parquet]", "distinct file names"),
        ("data.extra_tests=[d/test.parquet]", "other than test.parquet"),
        ("data.extra_tests=[3]", r"data.extra_tests\[0\]: expected a string"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config("configs/tiny-test.yaml", [bad])
    missing = load_config("configs/tiny-test.yaml", [f"data.extra_tests=[{tmp_path / 'gone.parquet'}]"])
    with pytest.raises(ConfigError, match=r"data.extra_tests\[0\]: .*gone.parquet does not exist"):
        check_paths(missing)


def _eval(rows: list[tuple[str, str, int, float]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["test_set", "prompt_id", "difficulty", "accuracy"]).assign(
        answered=1.0, boxed=0.5, accuracy_greedy=lambda d: d["accuracy"]
    )


def test_figures_and_paired_gains_per_held_out_set():
    before = _eval([("test", "a", 0, 0.0), ("test", "b", 1, 0.5), ("x", "x/a", 0, 0.25), ("x", "x/b", 1, 0.25)])
    after = _eval([("test", "a", 0, 1.0), ("test", "b", 1, 0.75), ("x", "x/a", 0, 0.5), ("x", "x/b", 1, 1.0)])
    assert list(split_test_sets(after)) == ["test", "x"]
    figures = eval_figures(after)
    assert (
        figures["accuracy"] == 0.875 and figures["by_difficulty"] == {"0": 1.0, "1": 0.75} and figures["prompts"] == 2
    )
    assert figures["test_sets"]["x"]["accuracy"] == 0.75 and figures["test_sets"]["x"]["prompts"] == 2
    gains = heldout_gains(before, after)
    assert gains["test"]["gain"] == pytest.approx(0.625)  # (1.0 + 0.25) / 2
    assert gains["test"]["se"] == pytest.approx(math.sqrt(((1 - 0.625) ** 2 + (0.25 - 0.625) ** 2) / 1) / math.sqrt(2))
    assert gains["x"]["gain"] == pytest.approx(0.5) and gains["x"]["prompts"] == 2
    # a table without test_set (an older run, coba-eval) is all data.test; one prompt has no standard error
    plain = after[after["test_set"] == "test"].drop(columns="test_set")
    assert "test_sets" not in eval_figures(plain) and eval_figures(plain)["accuracy"] == 0.875
    one = paired_gain(plain.head(1), plain.head(1))
    assert one["gain"] == 0.0 and math.isnan(one["se"]) and one["prompts"] == 1


def test_difficulties_keep_the_rows_of_those_levels(tmp_path, random_checkpoints):
    from helpers_reward import write_flat

    from coba_tasks.pipeline.data import keep_difficulties, load_run_datasets

    assert load_config("configs/tiny-test.yaml", ["data.difficulties=[0, 2]"]).data.difficulties == (0, 2)
    with pytest.raises(ConfigError, match=r"data.difficulties\[0\]: expected an integer"):
        load_config("configs/tiny-test.yaml", ["data.difficulties=[easy]"])
    frame = pd.DataFrame({"prompt_id": list("abcd"), "difficulty": [0, 1, 2, 0]})
    assert keep_difficulties(frame, (), "f").equals(frame)
    assert keep_difficulties(frame, (0,), "f")["prompt_id"].tolist() == ["a", "d"]
    with pytest.raises(
        ConfigError, match=r"data.difficulties = \[4\]: no row of f is of those levels \(it has levels 0, 1, 2\)"
    ):
        keep_difficulties(frame, (4,), "f")
    with pytest.raises(ConfigError, match="has no difficulty levels"):
        keep_difficulties(frame.assign(difficulty=-1), (0,), "f")
    # through a run's datasets: data.train, data.test and data.extra_tests alike
    train = write_flat(tmp_path / "train.parquet", ["1+1=", "22+3=", "2+2=", "40-5="], [0, 1, 0, 1])
    test = write_flat(tmp_path / "test.parquet", ["3+3=", "33+4="], [0, 1])
    extra = write_flat(tmp_path / "extra.parquet", ["3 + 3 =", "33 + 4 ="], [0, 1])
    model, _ = random_checkpoints
    overrides = [f"model.path={model}", f"data.train={train}", f"data.test={test}", f"data.extra_tests=[{extra}]"]
    data = load_run_datasets(load_config("configs/tiny-test.yaml", [*overrides, "data.difficulties=[0]"]))
    assert data.train["prompt_text"].tolist() == ["1+1=", "2+2="] and data.test["prompt_text"].tolist() == ["3+3="]
    assert data.extra_tests["extra"]["prompt_text"].tolist() == ["3 + 3 ="]
