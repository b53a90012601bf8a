"""`rlstream config import --from SYSTEM FILE`: the YAML on stdout loads with `config show` and trains a real
step; a file it cannot import is one line on stderr, exit 2 and nothing on stdout."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlstream.common.config import load_config_dict

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
AREAL = FIXTURES.parent / "data" / "areal_gsm8k_grpo.yaml"
CASES = {"roll": FIXTURES / "roll" / "rlvr_megatron.yaml", "cosmos": FIXTURES / "cosmos" / "qwen2-5-3b-grpo.toml",
         "rlinf": FIXTURES / "rlinf" / "grpo_megatron_sglang.yaml"}


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "config", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize("system", sorted(CASES))
def test_the_output_loads_with_config_show_and_the_summary_goes_to_stderr(system, tmp_path):
    run = _cli("import", "--from", system, str(CASES[system]))
    assert run.returncode == 0, run.stderr
    assert run.stderr.startswith("translated ") and "  dropped     " in run.stderr
    mine = tmp_path / "mine.yaml"
    mine.write_text(run.stdout)
    show = _cli("show", "--config", str(mine))
    assert show.returncode == 0, show.stderr
    assert "actor:" in show.stdout


def test_import_areal_stays_an_alias_of_import_from_areal():
    alias, new = _cli("import-areal", str(AREAL)), _cli("import", "--from", "areal", str(AREAL))
    assert alias.returncode == new.returncode == 0, alias.stderr
    assert alias.stdout.split("\n", 1)[1] == new.stdout.split("\n", 1)[1]  # the first line names the command


@pytest.mark.parametrize("system,file,message", [
    ("roll", CASES["rlinf"], "looks like an RLinf config (it has runner), not ROLL; import it with --from rlinf"),
    ("areal", CASES["roll"], "looks like a ROLL config (it has actor_train), not AReaL; import it with --from roll"),
    ("cosmos", CASES["rlinf"], "is not TOML but looks like an RLinf config; import it with --from rlinf"),
    ("rlinf", CASES["cosmos"], "is not YAML but looks like a cosmos-rl config; import it with --from cosmos"),
    ("rlinf", FIXTURES / "nothing-here.yaml", "cannot read"),
])
def test_a_file_it_cannot_import_is_one_line_and_exit_2(system, file, message):
    run = _cli("import", "--from", system, str(file))
    assert run.returncode == 2 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and str(file) in lines[0] and message in lines[0], run.stderr


def test_unparsable_and_foreign_files_say_what_to_do(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("runner: [1, 2\n")
    run = _cli("import", "--from", "rlinf", str(bad))
    assert run.returncode == 2 and run.stdout == "" and f"cannot read {bad} as YAML" in run.stderr
    other = tmp_path / "other.yaml"
    other.write_text("model: gpt\nepochs: 3\n")
    run = _cli("import", "--from", "roll", str(other))
    assert run.returncode == 2 and run.stdout == ""
    assert "has none of the keys of a ROLL config (actor_train, actor_infer, num_return_sequences_in_group)" in run.stderr
    unresolved = tmp_path / "interp.yaml"
    unresolved.write_text("runner:\n  max_steps: ${nowhere.steps}\n")
    run = _cli("import", "--from", "rlinf", str(unresolved))
    assert run.returncode == 2 and run.stdout == "" and "cannot resolve the ${...} interpolations" in run.stderr


def test_a_value_with_no_equivalent_names_the_key(tmp_path):
    f = tmp_path / "cosmos.toml"
    f.write_text("[policy]\nmodel_name_or_path = \"m\"\n[train.fp4]\nenable_fp4 = true\n")
    run = _cli("import", "--from", "cosmos", str(f))
    assert run.returncode == 2 and run.stdout == ""
    assert "train.fp4.enable_fp4=True: not in rlstream yet: FP4 training" in run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("system", sorted(CASES))
def test_an_imported_config_trains_one_real_step_on_cpu(system, tmp_path, redis_url, rclient, experiment,
                                                        tiny_model_path):
    """The imported config, with the model, data, broker and sizes of a CPU test put over it (as the other
    end-to-end tests do), runs one full train step on the tiny model."""
    from transformers import AutoModelForCausalLM

    from rlstream.broker import Keys, TrajectoryStream, namespace
    from rlstream.common.importers.reader import import_file
    from rlstream.consumer.synthetic import synthetic_groups
    from rlstream.trainer.main import train

    torch.set_num_threads(1)
    data = import_file(system, CASES[system]).config
    cpu = {"experiment_name": experiment, "trial_name": "trial0", "redis": {"url": redis_url},
           "cluster": {"fileroot": str(tmp_path / "runs")}, "total_train_steps": 1, "tokenizer_path": None,
           "rollout": {"consumer_batch_size": 2}, "gconfig": {"n_samples": 4, "max_new_tokens": 16},
           "recover": {"mode": "disabled"}, "saver": {"freq_steps": None}, "evaluator": {"freq_steps": None},
           "valid_dataset": None, "train_dataset": {"path": ""}, "launcher": {"n_trainer_procs": 1},
           "stats_logger": {"wandb": {"mode": "disabled"}, "tensorboard": {"enabled": False, "path": None}},
           "actor": {"path": str(tiny_model_path), "backend": "hf", "dtype": "float32", "weight_update_mode": "none",
                     "mb_spec": {"max_tokens_per_mb": 64}, "optimizer": {"lr": 1e-3}}}
    cfg = load_config_dict(_merge(data, cpu))
    tiny = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    stream = TrajectoryStream(rclient, Keys(namespace(experiment, "trial0")))
    for g in synthetic_groups(2, seed=5, vocab_size=tiny.config.vocab_size, model=tiny):
        stream.append(g)
    train(cfg)
    lines = (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and '"step": 1' in lines[0]
    assert (Path(cfg.run_dir) / "checkpoints" / "final" / "model.safetensors").is_file()


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
