"""The save pipeline without Lightning: the job, sync and background savers, staging, the writer
process and its protocol, change tracking for incremental saves, multi-rank planning. Imports
``format``, ``store``, ``remote`` and ``hostmem``."""
