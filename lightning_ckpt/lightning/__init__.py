"""Every class that imports Lightning: the plugin, the callbacks, the strategies, Fabric, the
callback's records, monitor, memory release, schedule and resume, and the adapters over the
engines below (``ChunkedOffloadStrategy``, ``ActivationCheckpointing``). Nothing is imported
here: ``lightning_ckpt/__init__.py`` resolves the public names lazily."""
