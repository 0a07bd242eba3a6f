"""Bytes into a local folder, atomically: shard files, the commit, multi-rank parts, and the
placing of reused files for incremental saves. Imports ``format`` only."""
