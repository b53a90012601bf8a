"""S3 upload of HF exports (`trainer.upload`, saver.upload_s3) against moto's S3 server on 127.0.0.1."""


import pytest

pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A real S3 HTTP endpoint (moto's server) with the bucket `ckpts`; yields its URL."""
    import os

    import boto3
    from moto.server import ThreadedMotoServer

    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(dict(zip(names, ("test", "test", "us-east-1"))))  # moto takes any credentials
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket="ckpts")
    yield url
    server.stop()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _objects(url: str, prefix: str) -> dict[str, bytes]:
    import boto3

    client = boto3.client("s3", endpoint_url=url)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="ckpts", Prefix=prefix).get("Contents", [])]
    return {k: client.get_object(Bucket="ckpts", Key=k)["Body"].read() for k in keys}


def test_every_export_is_uploaded_whole_also_when_pruned_right_after(s3, tmp_path, tiny_model_path):
    """max_keep=1 removes step-1 as soon as step-2 is written: its upload, queued before, still sends every file."""
    from transformers import AutoModelForCausalLM

    from rlstream.common.config import S3UploadConfig
    from rlstream.trainer.checkpoint import Checkpointer
    from rlstream.trainer.parallel import Parallel
    from rlstream.trainer.upload import make_uploader

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    uploader = make_uploader(S3UploadConfig(bucket="ckpts", prefix="team/runs", endpoint_url=s3), None, "exp/trial0")
    ckpt = Checkpointer(tmp_path, Parallel(), str(tiny_model_path), keep_hf=1, uploader=uploader)
    for name in ("step-1", "step-2", "final"):
        ckpt.save_hf(model, model, name)
    ckpt.close()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["final", "step-2"]  # nothing staged left
    for name in ("step-1", "step-2", "final"):
        got = _objects(s3, f"team/runs/exp/trial0/{name}/")
        files = sorted(p.name for p in (tmp_path / "checkpoints" / "final").iterdir())
        assert sorted(k.rsplit("/", 1)[1] for k in got) == files, name
    local = (tmp_path / "checkpoints" / "final" / "model.safetensors").read_bytes()
    assert _objects(s3, "team/runs/exp/trial0/final/model.safetensors")[
        "team/runs/exp/trial0/final/model.safetensors"] == local


def test_a_failed_upload_is_one_error_line_and_the_export_stays(s3, tmp_path, tiny_model_path):
    import logging

    from transformers import AutoModelForCausalLM

    from rlstream.common.config import ConfigError, S3UploadConfig
    from rlstream.trainer.checkpoint import Checkpointer
    from rlstream.trainer.parallel import Parallel
    from rlstream.trainer.upload import S3Destination, make_uploader

    records: list[logging.LogRecord] = []
    keep = logging.Handler(logging.ERROR)
    keep.emit = records.append  # rlstream's loggers do not propagate to caplog
    logger = logging.getLogger("rlstream.trainer.upload")
    logger.addHandler(keep)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ckpt = Checkpointer(tmp_path, Parallel(), None,
                        uploader=make_uploader(S3UploadConfig(bucket="no-such-bucket", endpoint_url=s3), None, "exp/t"))
    try:
        ckpt.save_hf(model, model, "final")
        ckpt.close()
    finally:
        logger.removeHandler(keep)
    errors = [r.getMessage() for r in records]
    assert len(errors) == 1 and "upload of checkpoint final to s3://no-such-bucket/exp/t/final failed" in errors[0]
    assert (tmp_path / "checkpoints" / "final" / "model.safetensors").is_file()
    assert not list((tmp_path / "checkpoints").glob(".upload-*"))
    with pytest.raises(ConfigError, match="saver.upload_s3.bucket is empty"):
        S3Destination(S3UploadConfig(), "exp/t")
