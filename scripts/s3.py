#!/usr/bin/env python3
"""A few S3 operations with boto3 (which comes with moto), for the tests and the
benchmark: the real client library's view of what ckpt wrote to or reads from a bucket.

  s3.py ENDPOINT mb BUCKET
  s3.py ENDPOINT put DIR s3://BUCKET/PREFIX        upload a local tree
  s3.py ENDPOINT get s3://BUCKET/PREFIX DIR        download a prefix as a tree
  s3.py ENDPOINT ls s3://BUCKET/PREFIX             keys and sizes under the prefix, as JSON
  s3.py ENDPOINT uploads BUCKET                    multipart uploads in progress, as JSON
  s3.py ENDPOINT start-upload s3://BUCKET/KEY      a multipart upload with one part, left open
  s3.py ENDPOINT truncate s3://BUCKET/KEY N        rewrite the object with its first N bytes
"""
import json
import os
import sys

import boto3


def split(url):
    assert url.startswith("s3://"), url
    bucket, _, key = url[5:].partition("/")
    return bucket, key.strip("/")


def main():
    endpoint, op, *args = sys.argv[1:]
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "test"),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "test"),
        region_name="us-east-1",
    )
    if op == "mb":
        s3.create_bucket(Bucket=args[0])
    elif op == "put":
        src, (bucket, prefix) = args[0], split(args[1])
        for root, _, files in os.walk(src):
            for f in files:
                p = os.path.join(root, f)
                rel = os.path.relpath(p, src).replace(os.sep, "/")
                s3.upload_file(p, bucket, f"{prefix}/{rel}" if prefix else rel)
    elif op == "get":
        (bucket, prefix), dst = split(args[0]), args[1]
        for o in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            for item in o.get("Contents", []):
                rel = item["Key"][len(prefix) + 1:]
                p = os.path.join(dst, rel)
                os.makedirs(os.path.dirname(p), exist_ok=True)
                s3.download_file(bucket, item["Key"], p)
    elif op == "ls":
        bucket, prefix = split(args[0])
        out = {}
        for o in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in o.get("Contents", []):
                out[item["Key"]] = item["Size"]
        print(json.dumps(out))
    elif op == "uploads":
        r = s3.list_multipart_uploads(Bucket=args[0])
        print(json.dumps([u["Key"] for u in r.get("Uploads", [])]))
    elif op == "start-upload":
        bucket, key = split(args[0])
        u = s3.create_multipart_upload(Bucket=bucket, Key=key)
        s3.upload_part(Bucket=bucket, Key=key, UploadId=u["UploadId"], PartNumber=1, Body=b"x" * (5 << 20))
        print(u["UploadId"])
    elif op == "truncate":
        bucket, key = split(args[0])
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        s3.put_object(Bucket=bucket, Key=key, Body=body[: int(args[1])])
    else:
        sys.exit(f"unknown operation {op}")


if __name__ == "__main__":
    main()
