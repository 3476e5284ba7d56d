"""Object storage for the cache (`dump_dir: s3://bucket/prefix`, `gs://`, `az://`, `memory://`),
on obstore (extra `[s3]`): the client built from the URL and the standard environment, the error
kinds, the lease that locks a namespace, and a namespace's objects. obstore is imported only when
an object-store URL is used."""
from skip_harness.store.objstore.client import ObjectClient, aws_config, is_object_url, join_url
from skip_harness.store.objstore.errors import (
    ObjectAccessDenied,
    ObjectBucketMissing,
    ObjectCorrupt,
    ObjectCredentialsRefused,
    ObjectMissing,
    ObjectRaceLost,
    ObjectStoreConfigError,
    ObjectStoreError,
    ObjectStoreForkError,
    ObjectStoreUnavailable,
)



def open_dump_dir(url: str):
    """The object-store DumpDir for `url` (the hook `skip_harness.store.backend.open_dump_dir` calls)."""
    from skip_harness.store.objstore.backend import ObjectDumpDir
    return ObjectDumpDir(url)


__all__ = ["open_dump_dir", "ObjectClient", "aws_config", "is_object_url", "join_url", "ObjectAccessDenied", "ObjectBucketMissing", "ObjectCorrupt", "ObjectCredentialsRefused",
           "ObjectMissing", "ObjectRaceLost", "ObjectStoreConfigError", "ObjectStoreError",
           "ObjectStoreForkError", "ObjectStoreUnavailable"]
