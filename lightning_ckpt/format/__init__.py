"""The on-disk format, pure: manifest, plan, reader, digests, and the readers of Lightning's own
checkpoints (legacy single files and DCP folders) and of ours through DCP. No writes, no Lightning."""
