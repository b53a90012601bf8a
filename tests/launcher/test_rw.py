"""`rlstream rw`: the Bradley–Terry loss against its formula, the pairs file, and a reward model trained on
synthetic pairs that the scoring engine then serves."""

from __future__ import annotations

import json
import random
import subprocess

import numpy as np
import pytest
import torch

from rlstream.launcher.rw import RW_MARKER, bradley_terry_loss, load_pairs, write_demo_pairs

from tests.helpers import child_env, cli

LETTERS = "abcdefghijklmnopqrstuvw"


def numpy_bradley_terry(chosen: np.ndarray, rejected: np.ndarray) -> float:
    """mean(-log sigmoid(r_c - r_r)), as AReaL's compute_rw_loss, written out with log1p for stability."""
    d = chosen.astype(np.float64) - rejected.astype(np.float64)
    return float(np.mean(np.where(d > 0, np.log1p(np.exp(-d)), -d + np.log1p(np.exp(d)))))


def test_bradley_terry_loss_equals_the_formula():
    rng = np.random.default_rng(0)
    for scale in (0.1, 1.0, 10.0, 60.0):
        c, r = rng.normal(0, scale, 257), rng.normal(0, scale, 257)
        got = float(bradley_terry_loss(torch.tensor(c), torch.tensor(r)))
        assert got == pytest.approx(numpy_bradley_terry(c, r), abs=1e-6, rel=1e-6)
    # equal scores: log 2; a pair far apart the right way: ~0
    assert float(bradley_terry_loss(torch.zeros(3), torch.zeros(3))) == pytest.approx(np.log(2), abs=1e-6)
    assert float(bradley_terry_loss(torch.tensor([50.0]), torch.tensor([0.0]))) < 1e-6


def write_pairs(path, n: int, seed: int = 0):
    """Prompts `dddd=`; the chosen response is the rejected one with one letter replaced by `x`: a reward model
    learns "contains x"."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = "".join(rng.choice("0123456789") for _ in range(4)) + "="
            rejected = [rng.choice(LETTERS) for _ in range(rng.randint(3, 8))]
            chosen = list(rejected)
            chosen[rng.randrange(len(chosen))] = "x"
            f.write(json.dumps({"prompt": prompt, "chosen": "".join(chosen), "rejected": "".join(rejected)}) + "\n")
    return path


def test_a_row_that_is_not_a_pair_names_the_key_and_line(tmp_path):
    path = write_pairs(tmp_path / "pairs.jsonl", 3)
    with open(path, "a") as f:
        f.write(json.dumps({"prompt": "p", "chosen": "c"}) + "\n")
    with pytest.raises(ValueError, match=r"rw.dataset=.* line 4: not a \{prompt, chosen, rejected\} row"):
        load_pairs(str(path))
    with pytest.raises(ValueError, match="is not a file"):
        load_pairs(str(tmp_path / "missing.jsonl"))


@pytest.mark.slow
def test_rw_learns_the_preference_and_writes_a_reward_model_the_pool_serves(tmp_path, tiny_model_path):
    from rlstream.engine.scoring import ScoringEngine

    pairs = write_pairs(tmp_path / "pairs.jsonl", 300)
    out = tmp_path / "rm"
    r = subprocess.run(cli("rw", f"actor.path={tiny_model_path}", f"rw.dataset={pairs}", "rw.steps=80",
                           f"reward_model.pool.model_path={out}"),
                       capture_output=True, text=True, timeout=600, env=child_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held-out pair accuracy" in r.stdout and str(out) in r.stdout
    marker = json.loads((out / RW_MARKER).read_text())
    assert marker["valid_pairs"] == 60 and marker["train_pairs"] == 240
    assert marker["valid_accuracy_after"] >= 0.9 > marker["valid_accuracy_before"] + 0.2
    # the written folder is what a scoring engine serves, and it ranks a held-out-like pair the learned way
    engine = ScoringEngine(str(out), device="cpu")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    ids = lambda resp: tok("1234=")["input_ids"] + tok(resp, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # noqa: E731
    with_x, without = engine.score([ids("abxde"), ids("abcde")])
    assert with_x > without


@pytest.mark.slow
def test_an_areal_rw_file_runs_as_rlstream_rw(tmp_path, tiny_model_path):
    """AReaL's RW experiment imported (`rlstream config import --from areal`), then run: its optimizer, schedule
    and epochs are the ones `rlstream rw` trains with."""
    import yaml

    pairs = write_pairs(tmp_path / "pairs.jsonl", 50)
    areal = {"experiment_name": "rw", "trial_name": "t0", "total_train_epochs": 1, "allocation_mode": "d1p1t1",
             "cluster": {"fileroot": str(tmp_path)},
             "actor": {"path": str(tiny_model_path), "is_critic": True,
                       "optimizer": {"type": "adam", "lr": 0.003, "lr_scheduler_type": "cosine", "gradient_clipping": 1.0}},
             "train_dataset": {"batch_size": 8, "path": str(pairs), "type": "rw"}}
    (tmp_path / "areal.yaml").write_text(yaml.safe_dump(areal))
    imported = subprocess.run(cli("config", "import", "--from", "areal", str(tmp_path / "areal.yaml")),
                              capture_output=True, text=True, timeout=300, env=child_env())
    assert imported.returncode == 0, imported.stderr[-2000:]
    (tmp_path / "rw.yaml").write_text(imported.stdout)
    out = tmp_path / "rm"
    r = subprocess.run(cli("rw", "--config", str(tmp_path / "rw.yaml"), f"rw.output_dir={out}"),
                       capture_output=True, text=True, timeout=600, env=child_env())
    assert r.returncode == 0, r.stderr[-3000:]
    marker = json.loads((out / RW_MARKER).read_text())
    assert marker["train_pairs"] == 40 and marker["steps"] == 5 and marker["lr"] == 0.003  # ceil(1 x 40 / 8)


@pytest.mark.parametrize("args,words", [
    (["rw.dataset=/nonexistent.jsonl"], "rw.dataset='/nonexistent.jsonl' is not a file"),
    (["rw.lr=0"], "rw.lr"),
    (["rw.valid_fraction=2"], "rw.valid_fraction"),
])
def test_bad_rw_config_is_one_line_and_exit_2(tmp_path, tiny_model_path, args, words):
    r = subprocess.run(cli("rw", f"actor.path={tiny_model_path}", *args), capture_output=True, text=True,
                       timeout=300, env=child_env())
    assert r.returncode == 2, r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("rlstream: error:")]
    assert len(err) == 1 and words in err[0], r.stderr[-2000:]


def test_demo_pairs_prefer_a_seven_and_differ_in_one_digit(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s[::-1]}) + "\n"
                             for s in ("1234", "7777", "0707", "9999")))
    assert write_demo_pairs(train, tmp_path / "pairs.jsonl", seed=0) == 4
    for pair in load_pairs(str(tmp_path / "pairs.jsonl")):
        assert "7" in pair.chosen and "7" not in pair.rejected and len(pair.chosen) == len(pair.rejected) == 4
        assert sum(a != b for a, b in zip(pair.chosen, pair.rejected)) == 1
        # the rejected response is the reversal, 7s replaced
        want = pair.prompt[:-1][::-1]
        assert all(r == w for r, w in zip(pair.rejected, want) if w != "7")
