"""Delta weight pushes (`actor.weight_update_delta`) against real `rlstream serve` engine processes.

"Bit-identical to a full push" is checked on the engines' own tensors: one engine gets
the versions as deltas, another the same versions in full (delta off); their served
tensors' raw bits (`/get_weights_bits`) and checksums (`/get_weights_checksum`) are
compared with each other and with the trainer's.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

from rlstream.common.weights.delta_codec import DeltaMismatch, bits_checksum, decode_tensor, encode
from tests.trainer.test_weights import (EngineProc, base_model, http, make_cfg, model_path,  # noqa: F401 - fixtures
                                        served_version)

torch.set_num_threads(1)


# ---------------------------------------------------------------------- encoding


def _step(t: torch.Tensor, lr: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (t.float() - lr * torch.randn(t.shape, generator=g)).to(t.dtype)


@pytest.mark.parametrize("encoding", ["sparse", "xor_zstd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_decode_is_bit_identical(encoding, dtype):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(300, 70, generator=g).to(dtype)
    for new in (_step(old, 1e-3, 1), _step(old, 1e-6, 2), old.clone(), torch.randn(300, 70, generator=g).to(dtype)):
        out = decode_tensor(old, encode(old, new, encoding), encoding)
        assert out.dtype == dtype and out.shape == new.shape
        assert torch.equal(out.view(torch.uint8), new.view(torch.uint8))
        assert bits_checksum(out) == bits_checksum(new)


@pytest.mark.parametrize("encoding", ["sparse", "xor_zstd"])
def test_corrupted_payload_is_refused_or_changes_the_checksum(encoding):
    old = torch.randn(64, 64)
    new = _step(old, 1e-2, 3)
    parts = encode(old, new, encoding)
    bad = [p.clone() for p in parts]
    bad[-1].view(torch.uint8)[len(bad[-1].view(torch.uint8)) // 2] ^= 0x5A
    try:
        out = decode_tensor(old, bad, encoding)
    except DeltaMismatch:
        return
    assert bits_checksum(out) != bits_checksum(new)


# ---------------------------------------------------------------------- pushes over real processes


@pytest.fixture(scope="module")
def engine_pair(tmp_path_factory, model_path):  # noqa: F811
    """Two unregistered engines: `delta` receives deltas, `full` full pushes (each test's first push is full)."""
    workdir = tmp_path_factory.mktemp("engines")
    started = [EngineProc(model_path, workdir, ["server.register=false"]) for _ in range(2)]
    try:
        yield {"delta": started[0].wait_ready(), "full": started[1].wait_ready()}
    finally:
        for e in started:
            e.stop()


def _bits(engine: EngineProc, name: str) -> bytes:
    status, out = http(engine.url + "/get_weights_bits", {"name": name})
    assert status == 200, out
    return base64.b64decode(out["bits"])


def _checksums(engine: EngineProc) -> dict[str, int]:
    status, out = http(engine.url + "/get_weights_checksum", {})
    assert status == 200, out
    return out["checksums"]


def _trained(model, seed: int, dtype: torch.dtype):
    """`model` after a small step that moves a tenth of the weights (in place)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=g) < 0.1
            p.add_((torch.randn(p.shape, generator=g) * 1e-3 * mask).to(dtype))
    return model


def _make(mode, delta, engine, redis_url, experiment, tmp_path, model_dir, extra=()):
    from rlstream.broker import Keys, namespace, connect
    from rlstream.trainer.weights import make_broadcaster

    cfg = make_cfg(redis_url, experiment, model_dir, tmp_path / experiment, mode,
                   [f"rollout.engine_addresses=[{engine.address}]", f"actor.weight_update_delta={delta}", *extra])
    client = connect(redis_url)
    return make_broadcaster(cfg, client, Keys(namespace(experiment, "trial0")), 0), client


@pytest.mark.parametrize("encoding", ["xor_zstd", "sparse"])
@pytest.mark.parametrize("mode", ["distributed", "disk"])
def test_delta_push_is_bit_identical_to_full_push(mode, encoding, engine_pair, base_model, model_path,  # noqa: F811
                                                  redis_url, experiment, tmp_path):
    import copy

    model = copy.deepcopy(base_model)
    made = [_make(mode, encoding, engine_pair["delta"], redis_url, experiment + "d", tmp_path, model_path),
            _make(mode, "none", engine_pair["full"], redis_url, experiment + "f", tmp_path, model_path)]
    try:
        (bd, _), (bf, _) = made
        kinds = []
        for version in (1, 2, 3):
            if version > 1:
                _trained(model, version, torch.float32)
            bd.push(model, version)
            bf.push(model, version)
            kinds.append(bd.last.kind)
            assert bf.last.kind == "full"
            assert served_version(engine_pair["delta"]) == served_version(engine_pair["full"]) == version
        assert kinds == ["full", "delta", "delta"], kinds  # the first push has no base
        assert bd.last.bytes < bf.last.bytes, (bd.last.bytes, bf.last.bytes)

        delta_sums, full_sums = _checksums(engine_pair["delta"]), _checksums(engine_pair["full"])
        assert delta_sums == full_sums
        for name, p in model.named_parameters():
            assert delta_sums[name] == bits_checksum(p), name
        for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
            got = _bits(engine_pair["delta"], name)
            assert got == _bits(engine_pair["full"], name), name
            assert got == model.state_dict()[name].contiguous().view(torch.uint8).numpy().tobytes(), name
    finally:
        for b, c in made:
            b.close()
            c.close()


@pytest.mark.parametrize("encoding", ["sparse", "xor_zstd"])
@pytest.mark.parametrize("mode", ["distributed", "disk"])
def test_corrupted_delta_falls_back_to_full_push(mode, encoding, engine_pair, base_model, model_path, redis_url,  # noqa: F811
                                               experiment, tmp_path):
    """A delta whose result misses the trainer's checksum is not applied; the full weights follow."""
    import copy

    engine = engine_pair["delta"]
    model = copy.deepcopy(base_model)
    b, client = _make(mode, encoding, engine, redis_url, experiment, tmp_path, model_path)
    try:
        b.push(model, 1)
        # One byte of one tensor's payload is flipped after encoding (in the trainer, before it is
        # sent): the engine's result cannot match the trainer's checksum of that tensor.
        name = "model.layers.0.self_attn.q_proj.weight"
        encode_bucket = b.delta.encode

        def corrupting(bucket, tensors, device):
            enc = encode_bucket(bucket, tensors, device)
            for spec, t in zip(enc.specs, enc.tensors):
                if spec.name in (f"{name}:val", f"{name}:xor"):
                    raw = t.view(torch.uint8)
                    raw[raw.numel() // 2] ^= 0xA5
            return enc

        b.delta.encode = corrupting
        _trained(model, 7, torch.float32)
        b.push(model, 2)
        b.delta.encode = encode_bucket

        assert b.last.kind == "fallback", b.last
        assert list(b.last.rejected) == [engine.address] and name in b.last.rejected[engine.address], b.last
        assert not b.last.dropped and b.last.engines == [engine.address]
        assert served_version(engine) == 2
        sums = _checksums(engine)
        assert all(sums[n] == bits_checksum(p) for n, p in model.named_parameters())
        assert _bits(engine, name) == model.state_dict()[name].contiguous().view(torch.uint8).numpy().tobytes()
        if mode == "disk":
            root = Path(b.cfg.run_dir) / "weights"
            assert (root / "v00000002" / "model.safetensors.index.json").is_file(), "the full folder was written"
            assert json.loads((root / "latest.json").read_text())["version"] == 2
        # the fallback left an exact base: the next push is a delta again
        _trained(model, 8, torch.float32)
        b.push(model, 3)
        assert b.last.kind == "delta" and served_version(engine) == 3
        assert all(_checksums(engine)[n] == bits_checksum(p) for n, p in model.named_parameters())
    finally:
        b.close()
        client.close()


def test_engine_behind_gets_a_full_push(engine_pair, base_model, model_path, redis_url, experiment,  # noqa: F811
                                        tmp_path):
    """An engine that does not serve the delta's base (it restarted, or another trainer wrote it) rejects it."""
    import copy

    engine = engine_pair["delta"]
    model = copy.deepcopy(base_model)
    b, client = _make("disk", "xor_zstd", engine, redis_url, experiment, tmp_path, model_path)
    try:
        b.push(model, 1)
        # Behind the broadcaster's back the engine loads other weights as version 5.
        other = tmp_path / "other"
        other.mkdir()
        from safetensors.torch import save_file

        save_file({k: v.contiguous() + 0.5 for k, v in model.state_dict().items()
                   if k == "model.norm.weight"}, str(other / "w.safetensors"))
        status, out = http(engine.url + "/update_weights_from_disk", {"model_path": str(other),
                                                                       "weight_version": "5"})
        assert status == 200, out
        _trained(model, 9, torch.float32)
        b.push(model, 2)
        assert b.last.kind == "fallback" and "serves 5" in b.last.rejected[engine.address]
        assert served_version(engine) == 2
        assert all(_checksums(engine)[n] == bits_checksum(p) for n, p in model.named_parameters())
    finally:
        b.close()
        client.close()
