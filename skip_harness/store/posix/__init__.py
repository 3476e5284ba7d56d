"""The local POSIX backend: fd-level atomic writes, O_DIRECT, page-cache dropping."""
