"""Consumer and trainer pieces on a tiny model and real Redis; one full `train` step end to end."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlstream.broker import Keys, StepLog, TrajectoryStream, VersionRegistry, namespace
from rlstream.common.config import load_config
from rlstream.common.wire import Trajectory, TrajectoryGroup
from rlstream.consumer.collate import collate
from rlstream.consumer.microbatch import minibatch_slices, split_by_token_budget, synced_split
from rlstream.consumer.packing import next_token_logits, packed_inputs, padded_inputs
from rlstream.consumer.reader import StepReader
from rlstream.consumer.synthetic import synthetic_groups
from rlstream.trainer.logprobs import token_logprobs

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


def _entries(stream, groups):
    ids = [stream.append(g) for g in groups]
    return stream.read_ids(ids)


# ---------------------------------------------------------------- packing and micro-batches
def test_packing_equals_padding_and_single_sequences(tiny, rclient, keys):
    vocab = tiny.config.vocab_size
    stream = TrajectoryStream(rclient, keys)
    entries = _entries(stream, synthetic_groups(3, seed=3, vocab_size=vocab, group_size=3, out_len=(2, 12), model=tiny))
    batch = collate(entries)
    assert len(set(batch.seq_lens.tolist())) > 1  # lengths differ, so padding is real
    with torch.no_grad():
        packed, ent_p = token_logprobs(tiny, batch, packing=True, with_entropy=True, temperature=0.7)
        padded, ent_d = token_logprobs(tiny, batch, packing=False, with_entropy=True, temperature=0.7)
        assert torch.allclose(packed, padded, atol=1e-5)
        assert torch.allclose(ent_p, ent_d, atol=1e-5)
        # Each sequence alone: the reference neither layout may deviate from.
        for i in range(batch.n_seqs):
            s, e = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
            ids = batch.input_ids[s:e][None]
            logits = tiny(input_ids=ids).logits[0].float() / 0.7
            want = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            assert torch.allclose(packed[s + 1:e], want, atol=1e-5)
            assert float(packed[s]) == 0.0
    # Every packed layout (rows as long as the longest sequence, one row as for flash
    # attention, with transformers' position-id masks or an explicit 4-D mask) gives the
    # padded logits, while computing fewer positions than padding.
    padded_in = padded_inputs(batch)
    with torch.no_grad():
        ref = next_token_logits(tiny(**padded_in.kwargs, use_cache=False).logits, padded_in)
        for kw in ({}, {"one_row": True}, {"explicit_mask": True}, {"one_row": True, "explicit_mask": True}):
            inp = packed_inputs(batch, **kw)
            got = next_token_logits(tiny(**inp.kwargs, use_cache=False).logits, inp)
            real = ~torch.isin(torch.arange(batch.n_tokens), batch.cu_seqlens[:-1])
            assert torch.allclose(got[real], ref[real], atol=1e-5), kw
        # Eager attention adds the mask to the scores: the explicit mask is additive.
        from transformers import AutoModelForCausalLM

        eager = AutoModelForCausalLM.from_pretrained(tiny.name_or_path, attn_implementation="eager").eval()
        for kw in ({}, {"explicit_mask": True}):
            inp = packed_inputs(batch, **kw)
            got = next_token_logits(eager(**inp.kwargs, use_cache=False).logits, inp)
            assert torch.allclose(got[real], ref[real], atol=1e-5), ("eager", kw)
    rows = packed_inputs(batch)
    assert rows.kwargs["input_ids"].shape[1] == int(batch.seq_lens.max())
    assert rows.grid_positions < padded_in.grid_positions
    # The synthetic behaviour logprobs follow the same convention at temperature 1.
    with torch.no_grad():
        logp, _ = token_logprobs(tiny, batch)
    assert torch.allclose(logp[batch.loss_mask], batch.behav_logp[batch.loss_mask], atol=1e-5)


def test_token_budget_split_and_minibatches():
    lens = [9, 3, 7, 2, 8, 1, 5]
    bins = split_by_token_budget(lens, max_tokens=12)
    assert sorted(i for b in bins for i in b) == list(range(len(lens)))
    assert all(sum(lens[i] for i in b) <= 12 for b in bins)
    assert len(bins) == 3  # 35 tokens need at least 3 bins of 12
    loads = [sum(lens[i] for i in b) for b in bins]
    assert max(loads) - min(loads) <= 2
    assert split_by_token_budget(lens, 12) == bins  # deterministic
    assert split_by_token_budget([20, 1], max_tokens=5) == [[0], [1]]  # too long: alone
    assert len(split_by_token_budget(lens, 100, min_mbs=4)) == 4
    assert synced_split([3, 4], 100, 1) == [[0, 1]]  # one process: nothing to agree
    assert [len(b) for b in split_by_token_budget([1, 1], 100, min_mbs=3)] == [1, 1, 0]
    assert minibatch_slices(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]


def test_lr_schedules():
    from rlstream.common.config import OptimizerConfig
    from rlstream.trainer.optim import lr_multiplier

    def lrs(kind, floor=0.0):
        cfg = OptimizerConfig(lr_scheduler_type=kind, warmup_steps_proportion=0.2, min_lr_ratio=floor)
        return [lr_multiplier(s, 10, cfg) for s in range(10)]

    assert lrs("constant") == pytest.approx([1 / 3, 2 / 3] + [1.0] * 8)
    assert lrs("linear", 0.2)[2:] == pytest.approx([1 - 0.8 * k / 8 for k in range(8)])
    cos = lrs("cosine")
    assert cos[2] == pytest.approx(1.0) and cos[-1] == pytest.approx(0.5 * (1 + np.cos(np.pi * 7 / 8)))
    assert all(a > b for a, b in zip(cos[2:], cos[3:]))


# ---------------------------------------------------------------- reader
def _group(version, n_out=3, token=5):
    t = Trajectory.from_arrays([4, 5], [token] * n_out, [-0.1] * n_out, [version] * n_out, 1.0, "stop")
    return TrajectoryGroup(group_id="g", prompt_id="p", producer_id="t", trajectories=[t, t])


def test_reader_drops_stale_and_dead_letters_bad_tokens(rclient, keys):
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    stale = stream.append(_group(version=1))
    bad = stream.append(_group(version=4, token=999))
    good = [stream.append(_group(version=v)) for v in (3, 4)]
    reader = StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=2, vocab_size=64, block_ms=50)
    reader.resume(0, replay=True)
    data = reader.next(step=0, version=5)
    assert data.ids == good
    assert data.n_dropped_stale == 1 and data.n_dead == 1
    dropped = rclient.xrange(keys.dropped)
    assert [f[b"source_id"].decode() for _, f in dropped] == [stale]
    assert b"head staleness 4 > max_head_offpolicyness 2" in dropped[0][1][b"reason"]
    assert [d["source_id"] for d in stream.dead_letters()] == [bad]
    # recorded before training; nothing acknowledged until the trainer says so
    assert StepLog(rclient, keys).for_step(0).entry_ids == good
    assert rclient.xpending(keys.traj, "train")["pending"] == 2
    assert reader.ack(good) == 2


def test_reader_replays_lost_steps_and_pending_first(rclient, keys):
    stream = TrajectoryStream(rclient, keys)
    ids = [stream.append(_group(version=0)) for _ in range(8)]
    r = StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=5, block_ms=50)
    r.resume(0, replay=True)
    s0, s1, s2 = r.next(0, 0), r.next(1, 1), r.next(2, 2)
    assert [s0.ids, s1.ids, s2.ids] == [ids[0:2], ids[2:4], ids[4:6]]
    r.ack(s0.ids)  # a checkpoint covered step 0 ...
    r.stream.read(r.consumer, count=1, block_ms=50)  # ... and step 3's first entry was read, then a crash
    # Restart from a checkpoint after step 1: step 1 was covered but not yet acknowledged.
    r2 = StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=5, block_ms=50)
    info = r2.resume(2, replay=True, covered_ids=s1.ids)
    assert info.replay_steps == [2] and info.leftover == 1
    again = r2.next(2, 2)
    assert again.replayed and again.ids == s2.ids
    s3 = r2.next(3, 3)  # the read-but-unrecorded entry first, then a new one: what an uninterrupted run reads
    assert not s3.replayed and s3.ids == ids[6:8]
    pending = {p["message_id"].decode() for p in rclient.xpending_range(keys.traj, "train", "-", "+", 100)}
    assert pending == set(s2.ids) | set(s3.ids)  # steps 0 and 1 acknowledged, 2 and 3 await a checkpoint


def test_acknowledged_history_is_never_replayed(rclient, keys):
    stream = TrajectoryStream(rclient, keys)
    ids = [stream.append(_group(version=0)) for _ in range(4)]
    first = StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=5, block_ms=50)
    first.resume(0, replay=False)
    first.ack(first.next(0, 0).ids)  # an earlier run without recovery trained and acked step 0
    again = StepReader(rclient, keys, groups_per_step=2, max_head_offpolicyness=5, block_ms=50)
    info = again.resume(0, replay=True)  # now with recovery, and no checkpoint yet
    assert info.replay_steps == [] and info.leftover == 0
    assert again.next(0, 0).ids == ids[2:4]


def test_restart_with_fewer_ranks_keeps_global_grouping(rclient, keys):
    stream = TrajectoryStream(rclient, keys)
    ids = [stream.append(_group(version=0)) for _ in range(6)]
    r0, r1 = (StepReader(rclient, keys, rank=r, world_size=2, groups_per_step=1, max_head_offpolicyness=5,
                         block_ms=50) for r in (0, 1))
    for r in (r0, r1):
        r.resume(0, replay=True)
    a0, a1 = r0.next(0, 0), r1.next(0, 0)  # step 0 (a checkpoint will cover it)
    b0, b1 = r0.next(1, 1), r1.next(1, 1)  # step 1 (lost in the crash)
    r1.stream.read(r1.consumer, count=1, block_ms=50)  # rank 1 read for step 2, then the crash
    # Restart as one rank from the checkpoint after step 0 (only rank 0's bookkeeping file is read).
    solo = StepReader(rclient, keys, rank=0, world_size=1, groups_per_step=2, max_head_offpolicyness=5, block_ms=50)
    assert solo.claim_orphans() == 3  # a1 (covered, not yet acked), b1 and the unrecorded read
    info = solo.resume(1, replay=True, covered_ids=a0.ids)
    assert info.replay_steps == [1] and info.leftover == 1
    again = solo.next(1, 1)
    assert again.replayed and again.ids == b0.ids + b1.ids  # the global step as it was
    assert solo.next(2, 2).ids == ids[4:6]
    pending = {p["message_id"].decode() for p in rclient.xpending_range(keys.traj, "train", "-", "+", 100)}
    assert pending == set(ids[2:6])  # step 0 acknowledged; steps 1-2 wait for a checkpoint


# ---------------------------------------------------------------- one full step
def _cfg(tmp_path, redis_url, experiment, model_path, *extra):
    return load_config(None, [
        f"experiment_name={experiment}", f"redis.url={redis_url}", f"actor.path={model_path}",
        f"cluster.fileroot={tmp_path / 'runs'}", "total_train_steps=1", "rollout.consumer_batch_size=2",
        "gconfig.n_samples=4", "actor.weight_update_mode=none", "actor.kl_ctl=0.0",
        "actor.optimizer.warmup_steps_proportion=0", "actor.optimizer.lr=1e-3", "actor.ppo_n_minibatches=2",
        "actor.mb_spec.max_tokens_per_mb=64", "recover.mode=disabled", "stats_logger.tensorboard.enabled=true",
        *extra])


def test_one_full_train_step(tmp_path, redis_url, rclient, experiment, tiny, tiny_model_path):
    from rlstream.trainer.main import train

    cfg = _cfg(tmp_path, redis_url, experiment, tiny_model_path, "actor.use_decoupled_loss=true",
               "actor.recompute_logprob=true", "actor.behav_imp_weight_cap=5.0")
    keys = Keys(namespace(experiment, "trial0"))
    stream = TrajectoryStream(rclient, keys)
    ids = [stream.append(g) for g in synthetic_groups(2, seed=11, vocab_size=tiny.config.vocab_size, model=tiny)]
    train(cfg)

    run = Path(cfg.run_dir)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["step"] == 1
    m = lines[0]
    for key in ("loss/total", "reward/mean", "reward/std", "reward/accuracy", "staleness/mean", "staleness/min",
                "staleness/max", "imp_weight/mean", "imp_weight/masked_frac", "ppo/clip_frac", "ppo/entropy",
                "optim/grad_norm", "optim/lr", "perf/tokens_per_s", "time/wait_data", "time/logprobs",
                "time/update", "time/weight_push"):
        assert key in m, key
    assert np.isfinite(m["loss/total"]) and m["optim/grad_norm"] > 0
    assert m["data/n_groups"] == 2 and m["data/n_seqs"] == 8
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))

    before = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    after = load_file(str(run / "checkpoints" / "final" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the weights moved
    assert (run / "checkpoints" / "final" / "tokenizer.json").is_file()

    assert StepLog(rclient, keys).for_step(0).entry_ids == ids
    assert rclient.xpending(keys.traj, "train")["pending"] == 0  # recovery off: acked after the step
    reg = VersionRegistry(rclient, keys)
    assert reg.get() == 1 and reg.get_trainer_version() == 1
    assert [e.type for _, e in reg.events_since()][-1] == "shutdown"


def test_stats_logger_all_sinks_offline(tmp_path, capsys):
    from rlstream.common.metrics import StatsLogger

    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", "stats_logger.wandb.mode=offline",
                             "stats_logger.tensorboard.enabled=true"])
    logger = StatsLogger(cfg, total_steps=2)
    logger.log(1, {"reward/mean": 0.5, "loss/total": 0.1, "bad": float("nan")})
    logger.log(2, {"reward/mean": 0.75, "loss/total": 0.05})
    logger.close()
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("step 1/2") and "reward 0.500" in out[0] and len(out) == 2
    run = Path(cfg.run_dir)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2] and "bad" not in recs[0]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    silent = StatsLogger(cfg, enabled=False)
    silent.log(3, {"x": 1.0})
    silent.close()


@pytest.mark.parametrize("algo", ["grpo", "drgrpo", "rloo", "dapo", "gspo"])
def test_algorithm_configs_train_a_step(algo, tmp_path, redis_url, rclient, experiment, tiny, tiny_model_path):
    """Each configs/algorithms/*.yaml, shrunk to the tiny model, runs a real step."""
    from rlstream.trainer.main import train

    path = Path(__file__).resolve().parents[1] / "configs" / "algorithms" / f"{algo}.yaml"
    cfg = load_config(path, [
        f"experiment_name={experiment}", f"redis.url={redis_url}", f"actor.path={tiny_model_path}",
        f"cluster.fileroot={tmp_path / 'runs'}", "train_dataset.path=''", "total_train_steps=1",
        "rollout.consumer_batch_size=2", "gconfig.n_samples=4", "gconfig.max_new_tokens=16",
        "actor.dtype=float32", "actor.weight_update_mode=none", "recover.mode=disabled",
        "stats_logger.tensorboard.enabled=false", "actor.optimizer.lr=1e-3", "actor.overlong_tokens=4"])
    stream = TrajectoryStream(rclient, Keys(cfg.namespace))
    for g in synthetic_groups(2, seed=4, vocab_size=tiny.config.vocab_size, model=tiny, out_len=(2, 16)):
        stream.append(g)
    train(cfg)
    m = json.loads((Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()[-1])
    assert np.isfinite(m["loss/total"]) and m["optim/grad_norm"] > 0
    assert ("kl/ref" in m) == (cfg.actor.kl_ctl > 0)
