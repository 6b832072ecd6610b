from typing import Any


def test_s3_roundtrip(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    import s3fs

    bucket, opts = s3_bucket
    fs = s3fs.S3FileSystem(**opts)
    fs.pipe(f"{bucket}/a/b.bin", b"hello")
    assert fs.cat(f"{bucket}/a/b.bin") == b"hello"
    assert fs.ls(f"{bucket}/a") == [f"{bucket}/a/b.bin"]
