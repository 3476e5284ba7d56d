"""Object storage for the cache (`dump_dir: s3://bucket/prefix`, `gs://`, `az://`, `memory://`),
on obstore (extra `[s3]`): the client built from the URL and the standard environment, the error
kinds, the storage (`storage`) and the lease that locks a namespace (`lease`, `locker`); `store.open`
builds the namespace on them (`open_storage`, `open_locker`). obstore is imported only when an
object-store URL is used."""
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


def open_storage(url: str, *, dump_dir: bool = False):
    """The object storage under `url` (the hook `store.open` calls for a URL)."""
    from skip_harness.store.objstore.storage import ObjectStorage
    return ObjectStorage(url, dump_dir=dump_dir)


def open_locker(storage):
    """The lease that locks the namespace `storage` holds (the hook `store.open` calls)."""
    from skip_harness.store.objstore.locker import LeaseLocker
    return LeaseLocker(storage)


__all__ = ["open_locker", "open_storage", "ObjectClient", "aws_config", "is_object_url", "join_url", "ObjectAccessDenied", "ObjectBucketMissing", "ObjectCorrupt", "ObjectCredentialsRefused",
           "ObjectMissing", "ObjectRaceLost", "ObjectStoreConfigError", "ObjectStoreError",
           "ObjectStoreForkError", "ObjectStoreUnavailable"]
