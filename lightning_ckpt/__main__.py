from lightning_ckpt.cli import main

raise SystemExit(main())
