"""What the research modes share beyond the package's lean benchmark core.

The package's ``lightning_ckpt.bench`` holds the parts its own ``save`` and ``async`` modes need
and that every mode here builds on too (``measure``: fresh processes, RSS, medians; ``report``:
tables and ``--json``; ``files``; ``workloads``: the synthetic checkpoint dict and the simulated
step; ``contenders``: Lightning's IO and ours). What only the research modes use lives here, so the
installed package carries none of it and nothing is written twice:

* ``contenders``: DCP ``async_save`` / ``save`` and ``disk_floor`` (a plain write in a helper process);
* ``plain_writer``: plain sequential writes (standard library only: also the helper process);
* ``workloads``: the decoder-only transformer, the dict ``Trainer`` builds from a live model, and
  the byte-for-byte comparison of a loaded checkpoint;
* ``measure``: system memory readings, p95, and :func:`~benchmarks.common.measure.run_grid`;
* ``arguments``: byte sizes and counts as command-line values;
* ``s3``: the local S3-compatible server (moto, on 127.0.0.1) of ``remote`` and ``compression``.

A mode module imports these and the package's core, never another mode.
"""
