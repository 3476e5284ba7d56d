"""The cache on storage: layout, records, status, scan, index, lock, retention and the backends."""
