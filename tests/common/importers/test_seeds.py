"""The seed references parse into every key they name (their text renderings lost some structure)."""

import json
from pathlib import Path

import pytest

from rlstream.common.importers.seeds import (SEED_FILES, SeedError, areal_keys, cosmos_keys, parse_seed_keys, rlinf_keys,
                                             roll_keys, seed_dir, snapshot_keys)

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def seeds() -> Path:
    """The references (../shared/seeds beside the repository, or $RLSTREAM_SEEDS). A clone without them (a CI
    checkout) cannot parse them: these tests say so and skip; the coverage check then runs from the snapshot."""
    folder = seed_dir(ROOT)
    if not all((folder / name).is_file() for name in SEED_FILES.values()):
        pytest.skip(f"the configuration references are not at {folder} (or $RLSTREAM_SEEDS)")
    return folder


def test_the_committed_snapshot_is_what_the_references_parse_to(seeds):
    for system in SEED_FILES:
        parsed = [[key, default] for key, default in parse_seed_keys(system, seeds)]
        assert json.loads(json.dumps(parsed)) == [list(x) for x in snapshot_keys(system)], \
            f"common/importers/seed_keys.json is stale for {system}: run `rlstream config coverage`"


def test_areal_tables_nest_by_their_section_links(seeds):
    keys = dict(areal_keys(seeds))
    assert float(keys["actor.optimizer.lr"]) == 2e-5  # `2e-05` in the table: YAML 1.1 reads it as text
    assert keys["allocation_mode"] == ""
    assert "actor.mb_spec.max_tokens_per_mb" in keys and "sglang.mem_fraction_static" in keys
    assert "critic.ppo_n_minibatches" in keys  # PPOConfig's critic section
    assert "actor" not in keys and "actor.optimizer" not in keys  # sections are not leaves
    assert len(keys) > 350


def test_roll_nesting_is_rebuilt_and_the_prose_strategies_added(seeds):
    keys = dict(roll_keys(seeds))
    assert keys["actor_train.strategy_args.strategy_name"] == "megatron_train"
    assert keys["actor_infer.strategy_args.strategy_config.gpu_memory_utilization"] == 0.6
    assert keys["actor_train.device_mapping"] == "list(range(0,16))"  # worker level, not strategy_config
    assert "actor_infer.strategy_args.strategy_config.mem_fraction_static" in keys  # SGLang, from the prose
    assert "actor_train.strategy_args.strategy_config.fsdp_size" in keys  # FSDP2, from the prose
    assert keys["num_return_sequences_in_group"] == 8


def test_cosmos_titles_become_field_names_and_refs_nest(seeds):
    keys = dict(cosmos_keys(seeds))
    assert keys["train.ckpt.save_freq"] == 20 and keys["train.ckpt.max_keep"] == 5
    assert "train.train_policy.aipo_rho" in keys and "policy.parallelism.tp_size" in keys
    assert "rollout.sampling_config.repetition_penalty" in keys and "validation.dataset.name" in keys


def test_rlinf_is_the_yaml_of_its_code_blocks(seeds):
    keys = dict(rlinf_keys(seeds))
    assert keys["algorithm.group_size"] == 2 and float(keys["actor.optim.lr"]) == 2e-05
    assert keys["algorithm.sampling_params.max_new_tokens"] == "${subtract:${runner.seq_length}, ${data.max_prompt_length}}"
    assert len(keys) == 165


def test_a_missing_seed_folder_is_one_line_saying_where(tmp_path):
    with pytest.raises(SeedError) as err:
        roll_keys(tmp_path)
    assert str(err.value).startswith(f"the roll configuration reference is expected at {tmp_path}/002_")
    assert "\n" not in str(err.value)
